"""Listing fine-tuning jobs: filtered and cut in SQL (on SQLite and on PostgreSQL with ZAYA_TEST_DATABASE_URL),
newest first, `after` a job id, `has_more` as OpenAI's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import event

from server.db.base import utcnow
from server.db.models import DEFAULT_PROJECT_ID, File, FineTuningJob
from server.errors import InvalidRequest
from server.services.access import Scope
from server.services.jobs import list_jobs

# Hostile keys too: a SQLite JSON path cannot name a key with a double quote.
METADATA = [{"team": "risk"}, {"team": "aml", 'we"ird.key': "x"}, None, {"team": "risk", "$": "a'b"}]


# Newest first: jobs 00 and 01 share a creation time, and the larger id comes first.
NEWEST_FIRST = ["ftjob-01", "ftjob-00", "ftjob-02", "ftjob-03", "ftjob-04", "ftjob-05", "ftjob-06"]


@pytest.fixture
def jobs(sessions) -> None:
    now = utcnow()
    with sessions() as session:
        dataset = File(
            filename="train.jsonl", purpose="fine-tune", bytes=1, sha256="0" * 64, project_id=DEFAULT_PROJECT_ID
        )
        session.add(dataset)
        session.flush()
        session.add_all(
            FineTuningJob(
                id=f"ftjob-{index:02d}",
                model="base",
                training_file_id=dataset.id,
                project_id=DEFAULT_PROJECT_ID,
                user_metadata=METADATA[index % len(METADATA)],
                created_at=now - timedelta(seconds=max(index, 1)),
            )
            for index in range(7)
        )
        session.commit()


def pages(session, limit: int, **filters) -> list[tuple[list[str], bool]]:
    """Every page, each asked for with the last id of the one before."""
    result, after = [], None
    while True:
        rows, has_more = list_jobs(session, Scope.everything(), after=after, limit=limit, **filters)
        result.append(([job.id for job in rows], has_more))
        if not has_more:
            return result
        after = rows[-1].id


def test_pages_follow_each_other_newest_first(sessions, jobs):
    with sessions() as session:
        assert pages(session, 3) == [(NEWEST_FIRST[0:3], True), (NEWEST_FIRST[3:6], True), (NEWEST_FIRST[6:], False)]
        assert pages(session, 7) == [(NEWEST_FIRST, False)]


def test_metadata_filters_and_limits_run_in_the_query(sessions, jobs):
    statements = []
    with sessions() as session:
        event.listen(session.get_bind(), "before_cursor_execute", lambda *args: statements.append(args[2]))
        assert pages(session, 2, metadata={"team": "risk"}) == [(["ftjob-00", "ftjob-03"], True), (["ftjob-04"], False)]
        assert pages(session, 5, metadata={'we"ird.key': "x"}) == [(["ftjob-01", "ftjob-05"], False)]
        assert pages(session, 5, metadata={"team": "risk", "$": "a'b"}) == [(["ftjob-03"], False)]
        assert pages(session, 5, metadata={"team": "nobody"}) == [([], False)]
    listings = [statement for statement in statements if "FROM fine_tuning_jobs" in statement]
    assert listings and all("LIMIT" in statement for statement in listings)


def test_after_an_unknown_job_names_the_parameter(sessions, jobs):
    with sessions() as session, pytest.raises(InvalidRequest) as error:
        list_jobs(session, Scope.everything(), after="ftjob-nope", limit=3)
    assert error.value.param == "after"
