"""Deterministic synthetic bank-investigation (AML / fraud) cases and chat examples built from them.

Everything comes from a seeded `random.Random`, so the same seed gives the same bytes. All people, accounts and
counterparties are invented.

Red flags, each decided from the case's facts alone:
- structuring: three or more cash deposits between 9,000.00 and 9,999.99 (just under the 10,000 reporting threshold);
- rapid movement of funds: an incoming wire of at least 10,000 followed within two days by outgoing wires that
  together move at least 80% of it onward;
- high-risk jurisdiction: any wire to or from a country in `HIGH_RISK_COUNTRIES`;
- sanctions near-match: the customer's name scores 0.75 or more against a sanctions list entry.

Disposition rules, applied in order (`decide_disposition`):
1. sanctions similarity of 0.90 or more -> SAR (treated as a confirmed match);
2. two or more red flags -> SAR;
3. exactly one red flag -> ESCALATE (needs a second-level review);
4. no red flag -> CLOSE (the alert was a false positive).

Three chat tasks use a case file: `summary`, `disposition` (answer starts with "Disposition: <LABEL>" then the
reason) and `sar_narrative` (only for SAR cases). `render_case_file` is plain text a pretraining corpus can reuse.
How a case is worded and its numbers formatted is its `Style` (`styles.py`; `STANDARD` unless given).
"""

from __future__ import annotations

import datetime
import random
import re
from dataclasses import dataclass
from typing import Any

from .styles import STANDARD, Style, with_reasons_of

DISPOSITIONS = ("CLOSE", "ESCALATE", "SAR")
TASKS = ("summary", "disposition", "sar_narrative")
RED_FLAGS = ("structuring", "rapid_movement", "high_risk_jurisdiction", "sanctions_near_match")
HIGH_RISK_COUNTRIES = ("Iran", "North Korea", "Myanmar", "Syria", "Yemen")
LOW_RISK_COUNTRIES = ("United States", "Canada", "Germany", "France", "Japan", "United Kingdom", "Netherlands")
SYSTEM_PROMPT = "You are an AML investigations assistant at a bank. Answer from the case file only."
TASK_PROMPTS = {
    "summary": "Summarise this case file for the investigations queue.",
    "disposition": "Recommend a disposition for this case (CLOSE, ESCALATE or SAR) and give the reason.",
    "sar_narrative": "Draft the narrative section of the suspicious activity report for this case.",
}

_FIRST_NAMES = ("Maria", "James", "Aisha", "Chen", "Lukas", "Priya", "Omar", "Elena", "David", "Fatima", "Kenji")
_LAST_NAMES = ("Okafor", "Novak", "Haddad", "Lindqvist", "Moreau", "Tanaka", "Castillo", "Brennan", "Iyer", "Petrov")
_OCCUPATIONS = ("nurse", "software engineer", "restaurant owner", "car dealer", "student", "retired teacher")
_COUNTERPARTIES = (
    "Harbor Trading LLC",
    "Blue Finch Imports",
    "Northgate Holdings",
    "Sunrise Textiles",
    "Atlas Freight Ltd",
    "Kestrel Consulting",
    "Orchid Electronics",
    "Meridian Supply Co",
)


@dataclass(frozen=True)
class Transaction:
    date: datetime.date
    kind: str  # "cash deposit", "wire in", "wire out", "card purchase", "ACH credit"
    amount: float
    counterparty: str
    country: str


@dataclass(frozen=True)
class Case:
    case_id: str
    customer_name: str
    occupation: str
    customer_since: datetime.date
    account_number: str
    risk_rating: str
    sanctions_score: float  # best similarity against the sanctions list, 0 when nothing came close
    transactions: tuple[Transaction, ...]

    @property
    def red_flags(self) -> list[str]:
        return find_red_flags(self)

    @property
    def disposition(self) -> str:
        return decide_disposition(self)


def find_red_flags(case: Case) -> list[str]:
    flags = []
    if len(_structuring_deposits(case)) >= 3:
        flags.append("structuring")
    if _rapid_movement_wire(case) is not None:
        flags.append("rapid_movement")
    if _high_risk_countries(case):
        flags.append("high_risk_jurisdiction")
    if case.sanctions_score >= 0.75:
        flags.append("sanctions_near_match")
    return flags


def decide_disposition(case: Case) -> str:
    if case.sanctions_score >= 0.90:
        return "SAR"
    flags = find_red_flags(case)
    return "SAR" if len(flags) >= 2 else "ESCALATE" if flags else "CLOSE"


def generate_case(rng: random.Random, disposition: str | None = None, number: int = 0) -> Case:
    """One case whose facts lead to `disposition` (random when None) under the documented rules; `number` is the
    case id's serial."""
    target = disposition or rng.choice(DISPOSITIONS)
    if target not in DISPOSITIONS:
        raise ValueError(f"unknown disposition {target!r} (expected one of {', '.join(DISPOSITIONS)})")
    if target == "CLOSE":
        flags: list[str] = []
    elif target == "ESCALATE":
        flags = [rng.choice(RED_FLAGS)]
    elif rng.random() < 0.25:
        flags = ["sanctions_near_match"]  # alone, with a score high enough to count as a confirmed match
    else:
        flags = rng.sample(RED_FLAGS, rng.choice((2, 2, 3)))
    start = datetime.date(2025, 1, 1) + datetime.timedelta(days=rng.randrange(330))
    transactions = _ordinary_transactions(rng, start) + _flag_transactions(rng, start, flags)
    sanctions_score = 0.0
    if "sanctions_near_match" in flags:
        confirmed = target == "SAR" and len(flags) == 1
        sanctions_score = round(rng.uniform(0.90, 0.98) if confirmed else rng.uniform(0.75, 0.89), 2)
    case = Case(
        case_id=f"CASE-{start.year}-{number:05d}",
        customer_name=f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}",
        occupation=rng.choice(_OCCUPATIONS),
        customer_since=start - datetime.timedelta(days=rng.randrange(200, 4000)),
        account_number=str(rng.randrange(10**9, 10**10)),
        risk_rating=rng.choice(("low", "medium", "high")),
        sanctions_score=sanctions_score,
        transactions=tuple(sorted(transactions, key=lambda transaction: transaction.date)),
    )
    assert case.disposition == target, "generator and rules disagree"  # a bug here would mislabel the data
    return case


def case_numbers(n: int, seed: int = 0) -> list[int]:
    """The id serials of a file of `n` cases: 0 to n - 1 shuffled by a stream of their own (the cases' other bytes
    stay as they are). The generators cycle the disposition with a case's position, so a serial that followed the
    position would give its label away, and a held-out case would share its id and label with a training case."""
    numbers = list(range(n))
    random.Random(f"case numbers {seed}").shuffle(numbers)
    return numbers


def generate_cases(n: int, seed: int = 0) -> list[Case]:
    """`n` cases cycling through the three dispositions, so the labels are balanced."""
    rng = random.Random(seed)
    numbers = enumerate(case_numbers(n, seed))
    return [generate_case(rng, DISPOSITIONS[index % len(DISPOSITIONS)], number) for index, number in numbers]


def generate_chat_examples(
    n: int, seed: int = 0, tasks: tuple[str, ...] = TASKS, style: Style = STANDARD, answer_style: Style | None = None
) -> list[dict[str, Any]]:
    """`n` chat examples in the OpenAI fine-tuning format, tasks taken in turn (SAR narratives use SAR cases), case
    files written in `style` and answers in `answer_style` (default: the same)."""
    unknown = set(tasks) - set(TASKS)
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tasks}")
    rng = random.Random(seed)
    examples = []
    for index, number in enumerate(case_numbers(n, seed)):
        task = tasks[index % len(tasks)]
        disposition = "SAR" if task == "sar_narrative" else DISPOSITIONS[(index // len(tasks)) % len(DISPOSITIONS)]
        examples.append(case_to_chat(generate_case(rng, disposition, number), task, style, answer_style))
    return examples


def generate_threshold_chats(
    n: int, seed: int = 0, style: Style = STANDARD, answer_style: Style | None = None
) -> list[dict[str, Any]]:
    """`n` disposition chats whose cases have the sanctions hit as their only red flag, SAR and ESCALATE in turn:
    the disposition comes down to whether the similarity is 0.90 or more, and nothing else in the case tells."""
    rng = random.Random(seed)
    examples = []
    for index, number in enumerate(case_numbers(n, seed)):
        disposition = ("SAR", "ESCALATE")[index % 2]
        case = generate_case(rng, disposition, number)
        while case.red_flags != ["sanctions_near_match"]:
            case = generate_case(rng, disposition, number)
        examples.append(case_to_chat(case, "disposition", style, answer_style))
    return examples


def case_to_chat(case: Case, task: str, style: Style = STANDARD, answer_style: Style | None = None) -> dict[str, Any]:
    """A chat whose user message holds the case file in `style` and whose answer is worded in `answer_style`
    (default: `style`), quoting values as the case file prints them."""
    answers = {"summary": summarise_case, "disposition": explain_disposition, "sar_narrative": draft_sar_narrative}
    if task not in answers:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    answer_style = style if answer_style is None else with_reasons_of(style, answer_style)
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{TASK_PROMPTS[task]}\n\n{render_case_file(case, style)}"},
            {"role": "assistant", "content": answers[task](case, answer_style)},
        ]
    }


def parse_disposition(answer: str) -> str | None:
    """The label of a `disposition` answer ("Disposition: SAR ..."), or None when there is none."""
    match = re.search(r"Disposition:\s*(CLOSE|ESCALATE|SAR)\b", answer, flags=re.IGNORECASE)
    return match.group(1).upper() if match else None


def render_case_file(case: Case, style: Style = STANDARD) -> str:
    wording, numbers = style.wording, style.numbers
    header = {
        "customer": wording.customer.format(
            name=case.customer_name,
            occupation=case.occupation,
            since=style.date(case.customer_since),
            risk=case.risk_rating,
        ),
        "account": wording.account.format(account=case.account_number),
        "alert": wording.alert.format(alert=wording.alerts[case.red_flags[0] if case.red_flags else None]),
        "sanctions": wording.sanctions_match.format(score=numbers.score(case.sanctions_score))
        if case.sanctions_score
        else wording.sanctions_none,
    }
    lines = [wording.case.format(case_id=case.case_id), *(header[name] for name in style.header_order)]
    lines.append(wording.transactions)
    lines += [
        wording.transaction.format(
            date=style.date(t.date),
            kind=wording.kinds[t.kind],
            amount=numbers.amount(t.amount),
            counterparty=t.counterparty,
            country=t.country,
        )
        for t in case.transactions
    ]
    return "\n".join(lines)


def summarise_case(case: Case, style: Style = STANDARD) -> str:
    incoming = sum(t.amount for t in case.transactions if t.kind in ("cash deposit", "wire in", "ACH credit"))
    outgoing = sum(t.amount for t in case.transactions if t.kind in ("wire out", "card purchase"))
    flags = ", ".join(flag.replace("_", " ") for flag in case.red_flags) or "none"
    return (
        f"{case.customer_name} ({case.occupation}, risk rating {case.risk_rating}) had {len(case.transactions)} "
        f"transactions: {style.numbers.amount(incoming)} in and {style.numbers.amount(outgoing)} out. "
        f"Red flags: {flags}."
    )


def explain_disposition(case: Case, style: Style = STANDARD) -> str:
    reasons = style.reasons
    if case.disposition == "CLOSE":
        because = reasons.no_flags
    elif case.sanctions_score >= 0.90:
        because = reasons.confirmed_match.format(score=style.numbers.score(case.sanctions_score))
    else:
        because = reasons.separator.join(_flag_reason(case, flag, style) for flag in case.red_flags)
    return f"Disposition: {case.disposition}\nReason: {because}."


def draft_sar_narrative(case: Case, style: Style = STANDARD) -> str:
    if case.disposition != "SAR":
        raise ValueError(f"{case.case_id} does not warrant a SAR")
    first, last = style.date(case.transactions[0].date), style.date(case.transactions[-1].date)
    reasons = "; ".join(_flag_reason(case, flag, style) for flag in case.red_flags)
    return (
        f"Between {first} and {last}, {case.customer_name}, a {case.occupation} holding account "
        f"{case.account_number}, conducted activity that the bank considers suspicious: {reasons}. "
        f"The bank is filing this report under case {case.case_id} and will keep monitoring the account."
    )


def _flag_reason(case: Case, flag: str, style: Style) -> str:
    """The reason sentence of one red flag, quoting the case's values as `style` prints them."""
    deposits = [style.numbers.amount(t.amount) for t in _structuring_deposits(case)]
    wire = _rapid_movement_wire(case)
    return style.reasons.flags[flag].format(
        n=len(deposits),
        amounts=", ".join(deposits[:-1]) + f" and {deposits[-1]}" if len(deposits) > 1 else "".join(deposits),
        wire_amount=style.numbers.amount(wire.amount) if wire else "",
        wire_date=style.date(wire.date) if wire else "",
        countries=", ".join(_high_risk_countries(case)),
        score=style.numbers.score(case.sanctions_score),
    )


def _structuring_deposits(case: Case) -> list[Transaction]:
    return [t for t in case.transactions if t.kind == "cash deposit" and 9_000 <= t.amount < 10_000]


def _rapid_movement_wire(case: Case) -> Transaction | None:
    """The first incoming wire of 10,000 or more that was moved onward (80% of it) within two days, if any."""
    for wire in case.transactions:
        if wire.kind == "wire in" and wire.amount >= 10_000:
            window = wire.date + datetime.timedelta(days=2)
            moved = sum(t.amount for t in case.transactions if t.kind == "wire out" and wire.date <= t.date <= window)
            if moved >= 0.8 * wire.amount:
                return wire
    return None


def _high_risk_countries(case: Case) -> list[str]:
    wires = (t for t in case.transactions if t.kind.startswith("wire"))
    return sorted({t.country for t in wires if t.country in HIGH_RISK_COUNTRIES})


def _ordinary_transactions(rng: random.Random, start: datetime.date) -> list[Transaction]:
    """Activity that raises no flag: small amounts, low-risk countries, incoming wires under 10,000."""
    kinds = ("ACH credit", "card purchase", "cash deposit", "wire in", "wire out")
    transactions = []
    for _ in range(rng.randrange(3, 7)):
        kind = rng.choice(kinds)
        amount = round(rng.uniform(40, 4_000), 2)
        transactions.append(_transaction(rng, start, kind, amount, rng.choice(LOW_RISK_COUNTRIES)))
    return transactions


def _flag_transactions(rng: random.Random, start: datetime.date, flags: list[str]) -> list[Transaction]:
    transactions = []
    if "structuring" in flags:
        for _ in range(rng.randrange(3, 6)):
            amount = round(rng.uniform(9_000, 9_999), 2)
            transactions.append(_transaction(rng, start, "cash deposit", amount, "United States"))
    if "rapid_movement" in flags:
        amount = round(rng.uniform(15_000, 90_000), 2)
        received = start + datetime.timedelta(days=rng.randrange(20))
        transactions.append(Transaction(received, "wire in", amount, rng.choice(_COUNTERPARTIES), "Germany"))
        share = rng.uniform(0.85, 0.98)
        for part in (0.6, 0.4):
            moved_on = received + datetime.timedelta(days=rng.randrange(3))
            onward = round(amount * share * part, 2)
            transactions.append(Transaction(moved_on, "wire out", onward, rng.choice(_COUNTERPARTIES), "Canada"))
    if "high_risk_jurisdiction" in flags:
        country = rng.choice(HIGH_RISK_COUNTRIES)
        kind = rng.choice(("wire in", "wire out"))
        transactions.append(_transaction(rng, start, kind, round(rng.uniform(2_000, 8_000), 2), country))
    return transactions


def _transaction(rng: random.Random, start: datetime.date, kind: str, amount: float, country: str) -> Transaction:
    date = start + datetime.timedelta(days=rng.randrange(30))
    if kind == "cash deposit":  # cash comes in over the counter, at home
        return Transaction(date, kind, amount, "branch counter", "United States")
    return Transaction(date, kind, amount, rng.choice(_COUNTERPARTIES), country)
