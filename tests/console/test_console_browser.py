"""The console end to end in headless Chromium (Debian's `chromium`, driven by Playwright): a real `zaya serve` and
`zaya worker` on 127.0.0.1 with a tiny random model. Each role signs in; the data team uploads datasets and runs a
job to success with its loss curves drawn; an admin promotes the version and manages keys; an analyst chats with it;
roles without rights see no controls and get 403 for forged requests. Screenshots go to the test's temporary
directory; with ZAYA_REFRESH_SCREENSHOTS=1 (`make screenshots`) they replace the README's in `docs/screenshots/`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright import sync_api as playwright_api

from server.db.migrations import upgrade
from server.db.models import Role
from server.db.session import make_engine, make_sessionmaker, session_scope
from server.services import registry
from server.services.keys import create_key

# The `chromium` on PATH, as `make browser` looks for it (Debian's package installs /usr/bin/chromium).
CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
README_SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
VIEWPORT = {"width": 1280, "height": 800}
BASE_MODEL = "zaya-tiny"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs chromium on PATH (`make browser` installs Debian's)"),
]


def chat_line(question: str, answer: str) -> bytes:
    record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    return json.dumps(record).encode() + b"\n"


TRAINING = b"".join(chat_line(f"Balance of account {i}?", f"It is {100 + i} EUR.") for i in range(12)) + chat_line(
    "Who opened case 7?", "Analyst jane.doe@example.com opened it."
)
VALIDATION = b"".join(chat_line(f"Balance of account {i}?", f"It is {100 + i} EUR.") for i in range(20, 24))
PREFERENCES = b"".join(
    json.dumps(
        {
            "input": {"messages": [{"role": "user", "content": f"Balance of account {i}?"}]},
            "preferred_output": [{"role": "assistant", "content": f"It is {100 + i} EUR."}],
            "non_preferred_output": [{"role": "assistant", "content": "I cannot say."}],
        }
    ).encode()
    + b"\n"
    for i in range(6)
)
INVALID = chat_line("Fine?", "Yes.") + b'{"messages": [{"role": "wizard", "content": "Hi"}]}\n'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    base_url: str
    keys: dict[str, str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir, fresh_database) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("console")
    with fresh_database(directory) as database_url:
        upgrade(database_url)
        engine = make_engine(database_url)
        with session_scope(make_sessionmaker(engine)) as session:
            version = registry.register_version(session, name=BASE_MODEL, path=tiny_model_dir)
            registry.promote(session, version, reason="base model for the console test", actor=None)
            keys = {role.value: create_key(session, name=f"{role.value} user", role=role).secret for role in Role}
        engine.dispose()

        env = {**os.environ, "ZAYA_DATA_DIR": str(directory / "data"), "ZAYA_DATABASE_URL": database_url}
        port = free_port()
        command = [sys.executable, "-m", "zaya_cli"]
        server = subprocess.Popen([*command, "serve", "--port", str(port)], env=env)
        worker = subprocess.Popen(
            [*command, "worker", "--poll-seconds", "0.2", "--heartbeat-seconds", "0.5", "--lease-seconds", "30"],
            env=env,
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            # Ready means the inference engine too: its start imports transformers in a thread, and a request
            # importing it at the same moment can fail (a lazy-import race outside the console).
            deadline = time.monotonic() + 240
            while True:
                assert server.poll() is None and worker.poll() is None, "zaya serve or zaya worker exited"
                assert time.monotonic() < deadline, "zaya serve did not become ready"
                try:
                    if httpx.get(f"{base_url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
            yield Stack(base_url=base_url, keys=keys)
        finally:
            for process in (worker, server):
                process.send_signal(signal.SIGTERM)
            for process in (worker, server):
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def signed_in(stack, browser):
    """A browser page per role, signed in through the sign-in form."""
    contexts = []

    def open_as(role: str):
        context = browser.new_context(base_url=stack.base_url, viewport=VIEWPORT)
        contexts.append(context)
        page = context.new_page()
        page.on("dialog", lambda dialog: dialog.accept())
        page.goto("/console/login")
        page.get_by_label("API key").fill(stack.keys[role])
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url("**/console/{jobs,playground}")
        return page

    pages = {role.value: open_as(role.value) for role in Role}
    yield pages
    for context in contexts:
        context.close()


@pytest.fixture(scope="module")
def screenshot(tmp_path_factory):
    """Save a full-page PNG: into the test's temporary directory, or over the README's when asked to refresh them."""
    refresh = os.environ.get("ZAYA_REFRESH_SCREENSHOTS") == "1"
    directory = README_SCREENSHOTS if refresh else tmp_path_factory.mktemp("screenshots")

    def save(page, name: str) -> None:
        path = directory / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.read_bytes().startswith(b"\x89PNG"), path

    return save


def forge(page, method: str, url: str, body: dict | None = None) -> int:
    """A request the page's own session sends with its CSRF token, as a user could from the browser's console."""
    return page.evaluate(
        """async ([method, url, body]) => {
            const token = document.querySelector('meta[name="csrf-token"]').content;
            const response = await fetch(url, {method, credentials: "same-origin",
                headers: {"Content-Type": "application/json", "X-CSRF-Token": token},
                body: body === null ? undefined : JSON.stringify(body)});
            return response.status;
        }""",
        [method, url, body],
    )


def upload(page, name: str, content: bytes) -> str:
    page.get_by_label("JSONL file").set_input_files(
        files=[{"name": name, "mimeType": "application/jsonl", "buffer": content}]
    )
    page.get_by_role("button", name="Upload and validate").click()
    result = page.locator("#upload-result")
    playwright_api.expect(result).to_contain_text(name if content is INVALID else "Uploaded and valid")
    return result.inner_text().rsplit(" is ", 1)[-1].rstrip(".")


def create_job(
    page,
    training_file: str,
    validation_file: str = "",
    *,
    suffix: str = "",
    max_steps: int,
    eval_every: int,
    epochs: int,
    dpo_beta: float | None = None,
) -> str:
    """Fill in the new-job form (a DPO job with `dpo_beta`); returns the job id from the job page it opens."""
    page.goto("/console/jobs")
    page.get_by_label("Base model").select_option(BASE_MODEL)
    if dpo_beta is not None:
        page.get_by_label("Training type").select_option("dpo")
        page.get_by_label("Beta (DPO; empty: auto)").fill(str(dpo_beta))
    page.get_by_label("Training file").select_option(training_file)
    page.get_by_label("Validation file").select_option(validation_file)
    page.get_by_label("Suffix").fill(suffix)
    page.get_by_label("Max steps").fill(str(max_steps))
    page.get_by_label("Evaluate every (steps)").fill(str(eval_every))
    page.get_by_label("Epochs").fill(str(epochs))
    page.get_by_role("button", name="Create job").click()
    wait_until(
        page, "location.pathname.startsWith('/console/jobs/') || !document.querySelector('#new-job-error')?.hidden"
    )
    assert "/console/jobs/ftjob-" in page.url, page.locator("#new-job-error").inner_text()
    page.wait_for_load_state()
    return page.url.rsplit("/", 1)[-1]


def wait_until(page, expression: str, timeout_s: float = 30) -> None:
    """Poll `expression` in the page until it is true. Playwright's wait_for_function compiles its predicate with
    `new Function`, which the console's Content-Security-Policy (no unsafe-eval) refuses; evaluate() is not script
    from the page's point of view."""
    deadline = time.monotonic() + timeout_s
    while not evaluate_across_navigation(page, expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s} s: {expression}"
        page.wait_for_timeout(100)


def evaluate_across_navigation(page, expression: str):
    try:
        return page.evaluate(expression)
    except playwright_api.Error as error:  # the page navigated while evaluating: ask the next page
        if "context was destroyed" not in str(error):
            raise
        page.wait_for_load_state()
        return page.evaluate(expression)


def polyline_points(page, series: str) -> int:
    line = page.locator(f'#loss-chart polyline[data-series="{series}"]')
    return len(line.get_attribute("points").split()) if line.count() else 0


def test_sign_in_page_and_a_wrong_key(stack, browser, screenshot):
    context = browser.new_context(base_url=stack.base_url, viewport=VIEWPORT)
    page = context.new_page()
    page.goto("/console/jobs")  # no session: sent to sign in, and back here afterwards
    assert "/console/login?next=/console/jobs" in page.url
    screenshot(page, "login")
    page.get_by_label("API key").fill("zk-wrong")
    page.get_by_role("button", name="Sign in").click()
    playwright_api.expect(page.get_by_role("alert")).to_contain_text("Invalid or revoked API key")
    # Keyboard only: the key field has focus, Enter submits; the first Tab stop on a page skips to its content.
    page.keyboard.type(stack.keys["data"])
    page.keyboard.press("Enter")
    page.wait_for_url("**/console/jobs")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    [cookie] = [c for c in context.cookies() if c["name"] == "zaya_console"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert page.evaluate("document.cookie") == ""  # scripts cannot read the session
    context.close()


def test_roles_without_rights_see_no_controls_and_forged_requests_get_403(signed_in):
    navigation = {role: page.locator("header nav a").all_inner_texts() for role, page in signed_in.items()}
    assert navigation["analyst"] == ["Playground"]
    assert navigation["data"] == ["Jobs", "Datasets", "Playground"]
    assert navigation["admin"] == ["Jobs", "Datasets", "Model versions", "Keys", "Audit log", "Playground"]

    analyst, data = signed_in["analyst"], signed_in["data"]
    for page, path in [(analyst, "/console/jobs"), (analyst, "/console/keys"), (data, "/console/models")]:
        response = page.goto(path)
        assert response.status == 403 and "permission_error" in page.content()
    analyst.goto("/console/playground")
    data.goto("/console/datasets")
    assert analyst.get_by_role("button", name="Revoke").count() == 0
    assert data.get_by_role("button", name="Promote").count() == 0
    for page in (analyst, data):
        assert forge(page, "POST", "/v1/admin/keys", {"name": "forged", "role": "admin"}) == 403
        assert forge(page, "POST", "/v1/admin/model_aliases/rollback", {"model_name": BASE_MODEL, "reason": "x"}) == 403
    assert forge(analyst, "POST", "/v1/fine_tuning/jobs", {"model": BASE_MODEL, "training_file": "file-x"}) == 403


def test_upload_train_promote_and_chat(signed_in, screenshot):
    data, admin, analyst = signed_in["data"], signed_in["admin"], signed_in["analyst"]

    # Datasets: a refused upload shows the validator's report with line numbers; good files are stored.
    data.goto("/console/datasets")
    upload(data, "broken.jsonl", INVALID)
    problems = data.locator("#upload-problems tr")
    playwright_api.expect(problems.first).to_contain_text("2")
    assert "role" in problems.first.inner_text()
    training_file = upload(data, "accounts-train.jsonl", TRAINING)
    validation_file = upload(data, "accounts-valid.jsonl", VALIDATION)
    assert training_file.startswith("file-") and validation_file.startswith("file-")
    screenshot(data, "datasets")

    # The validation report, PII report and the template-aware preview with its trained tokens.
    data.goto(f"/console/datasets/{training_file}?model={BASE_MODEL}&line=13")
    playwright_api.expect(data.locator("#validation-verdict")).to_contain_text("Valid: 13 examples")
    assert "trained" in data.locator("#validation-verdict").inner_text()
    assert data.locator("#pii-table tr", has_text="email").locator("td").nth(1).inner_text() == "1"
    trained = data.locator("#preview mark.trained").all_inner_texts()
    assert any("jane.doe@example.com" in text for text in trained)  # the assistant turn is trained
    assert "Who opened case 7?" not in "".join(trained)  # the user turn is context only
    screenshot(data, "dataset")

    # A job from the form, watched live to success with both loss curves.
    job_id = create_job(data, training_file, validation_file, suffix="accounts", max_steps=12, eval_every=4, epochs=20)
    playwright_api.expect(data.locator("#job-status")).to_have_text("succeeded", timeout=150_000)
    playwright_api.expect(data.locator("#job")).to_have_attribute("data-live", "done")
    assert polyline_points(data, "train") >= 3
    assert polyline_points(data, "valid") == 3  # steps 4, 8, 12
    assert data.locator("#checkpoints tbody tr").count() >= 1
    assert data.locator("[data-job-action]:enabled").count() == 0  # nothing to control on a finished job
    fine_tuned = data.locator("#job-model").inner_text()
    assert fine_tuned.startswith(f"ft:{BASE_MODEL}") and fine_tuned.endswith(job_id)
    # The run ended with answers generated for the validation file, scored as the page shows them.
    playwright_api.expect(data.locator("#job-evaluation")).to_contain_text("(4 examples)")
    data.reload()  # the page as rendered for a finished job: what it trained and on how many devices
    assert int(data.locator("#job-trained-tokens").inner_text()) > 0
    assert data.locator("#job-devices").inner_text() == "1"
    assert data.locator("#job-estimated-finish").inner_text() == "—"  # only a running job has one
    screenshot(data, "job")
    data.goto("/console/jobs")
    playwright_api.expect(data.locator("tr", has_text=job_id)).to_contain_text("succeeded")
    screenshot(data, "jobs")

    # A preference (DPO) job from the same form, on preference pairs.
    data.goto("/console/datasets")
    pairs = upload(data, "accounts-pairs.jsonl", PREFERENCES)
    dpo_job = create_job(data, pairs, suffix="pairs", max_steps=3, eval_every=3, epochs=20, dpo_beta=0.2)
    playwright_api.expect(data.locator("#job-status")).to_have_text("succeeded", timeout=150_000)
    assert '"beta": 0.2' in data.locator("dd", has_text='"type": "dpo"').inner_text() and dpo_job

    # Admin: the version's lineage, a promotion with its reason in the alias history.
    admin.goto("/console/models")
    row = admin.locator("#versions tr", has_text=fine_tuned)
    playwright_api.expect(row).to_contain_text("training file accounts-train.jsonl")
    playwright_api.expect(row.locator(".task-evaluation")).to_contain_text("exact match")
    row.get_by_label("Reason (required)").fill("held-out loss reviewed")
    row.get_by_role("button", name="Promote").click()
    playwright_api.expect(admin.locator("#flash")).to_contain_text("Promotion of")
    playwright_api.expect(admin.locator("#aliases")).to_contain_text(f"{fine_tuned}@production")
    history = admin.locator("#alias-history tr", has_text=fine_tuned)
    playwright_api.expect(history).to_contain_text("held-out loss reviewed")
    screenshot(admin, "models")

    # Admin: a key's secret is shown once; revoking it; the audit log filtered by action.
    admin.goto("/console/keys")
    admin.get_by_label("Project name").fill("risk")
    admin.get_by_role("button", name="Create project").click()
    playwright_api.expect(admin.locator("#flash")).to_contain_text("Project created")
    admin.get_by_label("Name", exact=True).fill("second analyst")
    admin.get_by_label("Role").select_option("analyst")
    admin.get_by_label("Project", exact=True).select_option(label="risk")
    admin.get_by_role("button", name="Create", exact=True).click()
    secret = admin.locator("#new-secret-value")
    playwright_api.expect(admin.locator("#new-secret")).to_be_visible()
    new_secret = secret.input_value()
    assert new_secret.startswith("zk-")
    playwright_api.expect(admin.locator("#keys tr", has_text="second analyst")).to_contain_text("risk")
    screenshot(admin, "keys")
    admin.reload()
    assert new_secret not in admin.content()
    admin.get_by_role("button", name="Revoke second analyst").click()
    playwright_api.expect(admin.locator("#flash")).to_contain_text("Key revoked")
    assert admin.get_by_role("button", name="Revoke second analyst").count() == 0
    admin.goto("/console/audit?action=keys.create")
    actions = admin.locator("#audit tbody tr td:nth-child(4)").all_inner_texts()
    assert actions and set(actions) == {"keys.create"}
    admin.goto("/console/audit")
    screenshot(admin, "audit")

    # Analyst: a streamed chat with the fine-tuned model; the request's settings are shown.
    analyst.goto("/console/playground")
    analyst.get_by_label("Model", exact=True).select_option(fine_tuned)
    analyst.get_by_label("Seed (empty: random)").fill("1")
    analyst.get_by_label("Message", exact=True).fill("Balance of account 3?")
    analyst.get_by_role("button", name="Send").click()
    playwright_api.expect(analyst.locator("#conversation")).to_have_attribute("data-done", "2", timeout=60_000)
    assert analyst.locator(".message.assistant .content").inner_text().strip()
    sent = json.loads(analyst.locator("#pg-request").inner_text())
    assert sent["model"] == fine_tuned and sent["stream"] is True and sent["seed"] == 1
    assert "completion tokens" in analyst.locator("#pg-usage").inner_text()
    screenshot(analyst, "playground")


def test_pause_resume_and_cancel_a_running_job_with_a_live_curve(signed_in):
    data = signed_in["data"]
    data.goto("/console/datasets")
    training_file = upload(data, "long-train.jsonl", TRAINING)
    create_job(data, training_file, max_steps=5000, eval_every=5000, epochs=100)

    playwright_api.expect(data.locator("#job-status")).to_have_text("running", timeout=60_000)
    wait_until(data, "document.querySelector('#job').dataset.points >= 2", timeout_s=60)
    before = polyline_points(data, "train")
    wait_until(data, f"document.querySelector('#job').dataset.points > {before}", timeout_s=60)

    data.get_by_role("button", name="Pause").click()
    playwright_api.expect(data.locator("#job-status")).to_have_text("paused", timeout=60_000)
    playwright_api.expect(data.get_by_role("button", name="Resume")).to_be_enabled()
    playwright_api.expect(data.locator("#checkpoints tbody tr")).to_have_count(1)  # pausing checkpoints the job
    data.get_by_role("button", name="Resume").click()
    playwright_api.expect(data.locator("#job-status")).to_have_text("running", timeout=60_000)
    data.get_by_role("button", name="Cancel").click()
    playwright_api.expect(data.locator("#job-status")).to_have_text("cancelled", timeout=60_000)
    assert data.locator("#events").inner_text().count("Cancellation requested") == 1
