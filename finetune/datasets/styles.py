"""How a synthetic bank case is written: the case file's wording, field order and number formats, and the wording of
the investigator's reasons. The facts and the rules that decide a case (`synthetic.py`) never change with the style.

A style is chosen by name (`VARIANTS`: `standard` is the sample's original wording; `ledger` and `memo` word, order
and format everything differently) or drawn from an integer seed (`style_from_seed`: each part taken at random from
the same pools), so a recipe can be checked on wordings it was not tuned on. The reasons copy the case file's values
in the case file's own formats (an amount printed "USD 9459.14" is quoted so), which is what a fine-tuned model has
to learn to do.
"""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass, replace

# The header lines of a case file besides its first (the case id) and the transactions that close it.
HEADER_FIELDS = ("customer", "account", "alert", "sanctions")
RED_FLAG_NAMES = ("structuring", "rapid_movement", "high_risk_jurisdiction", "sanctions_near_match")


@dataclass(frozen=True)
class NumberFormat:
    """Amounts (thousands separator, decimal mark, currency before or after), similarity scores (0.83 or 83%)."""

    thousands: str = ","
    decimal: str = "."
    currency: str = "USD"
    currency_first: bool = False
    percent_scores: bool = False

    def amount(self, value: float) -> str:
        whole, cents = f"{value:,.2f}".split(".")
        number = whole.replace(",", self.thousands) + self.decimal + cents
        return f"{self.currency} {number}" if self.currency_first else f"{number} {self.currency}"

    def score(self, value: float) -> str:
        return f"{round(value * 100)}%" if self.percent_scores else f"{value:.2f}"


@dataclass(frozen=True)
class CaseFileWording:
    """The case file's labels and sentences; `{...}` fields are filled in by `synthetic.render_case_file`."""

    case: str
    customer: str
    account: str
    alert: str
    sanctions_match: str
    sanctions_none: str
    transactions: str
    transaction: str  # one line: {date} {kind} {amount} {counterparty} {country}
    kinds: dict[str, str]  # the generator's transaction kinds as this file names them
    alerts: dict[str | None, str]  # the alert's text by the first red flag (None: no flag)


@dataclass(frozen=True)
class ReasonWording:
    """The closing note's sentences: one per red flag, joined by `separator`, or the fixed ones."""

    flags: dict[str, str]  # {n} {amounts} {wire_amount} {wire_date} {countries} {score}
    confirmed_match: str  # {score}
    no_flags: str
    separator: str = "; "


@dataclass(frozen=True)
class Style:
    name: str
    wording: CaseFileWording
    header_order: tuple[str, ...]
    numbers: NumberFormat
    date_format: str  # strftime
    reasons: ReasonWording

    def date(self, value: datetime.date) -> str:
        return value.strftime(self.date_format)


_STANDARD_KINDS = {k: k for k in ("cash deposit", "wire in", "wire out", "card purchase", "ACH credit")}
_STANDARD_ALERTS: dict[str | None, str] = {
    "structuring": "multiple cash deposits just below the reporting threshold",
    "rapid_movement": "funds received and sent onward within days",
    "high_risk_jurisdiction": "wire activity involving a high-risk jurisdiction",
    "sanctions_near_match": "customer name similar to a sanctions list entry",
    None: "unusual increase in account activity",
}

WORDINGS = {
    "standard": CaseFileWording(
        case="Case {case_id}",
        customer="Customer: {name}, {occupation}, customer since {since}, risk rating {risk}",
        account="Account: {account}",
        alert="Alert: {alert}",
        sanctions_match="Sanctions screening: near-match, similarity {score}",
        sanctions_none="Sanctions screening: no match",
        transactions="Transactions:",
        transaction="- {date} {kind} {amount}, {counterparty} ({country})",
        kinds=_STANDARD_KINDS,
        alerts=_STANDARD_ALERTS,
    ),
    "ledger": CaseFileWording(
        case="Investigation file {case_id}",
        customer="Client: {name} ({occupation}); risk {risk}; client since {since}",
        account="Account no.: {account}",
        alert="Alert reason: {alert}",
        sanctions_match="Screening result: possible hit at {score}",
        sanctions_none="Screening result: no hit",
        transactions="Activity:",
        transaction="* {date} | {kind} | {counterparty}, {country} | {amount}",
        kinds={
            "cash deposit": "cash deposit",
            "wire in": "incoming wire",
            "wire out": "outgoing wire",
            "card purchase": "card payment",
            "ACH credit": "ACH credit",
        },
        alerts={
            "structuring": "cash deposits under the reporting limit",
            "rapid_movement": "pass-through of incoming funds",
            "high_risk_jurisdiction": "wires with a high-risk country",
            "sanctions_near_match": "name screening hit",
            None: "activity above the usual level",
        },
    ),
    "memo": CaseFileWording(
        case="Reference: {case_id}",
        customer="Account holder: {name}, occupation {occupation}, opened {since}, rated {risk} risk",
        account="Account number {account}",
        alert="Monitoring alert - {alert}",
        sanctions_match="Watchlist similarity: {score}",
        sanctions_none="Watchlist similarity: none",
        transactions="Recent transactions",
        transaction="{date}: {amount} {kind}; {counterparty}; {country}",
        kinds={
            "cash deposit": "cash in",
            "wire in": "wire received",
            "wire out": "wire sent",
            "card purchase": "card spend",
            "ACH credit": "ACH in",
        },
        alerts={
            "structuring": "repeated cash just below the reporting limit",
            "rapid_movement": "money in and straight out",
            "high_risk_jurisdiction": "high-risk country involved",
            "sanctions_near_match": "possible watchlist match",
            None: "volume change",
        },
    ),
}

REASON_WORDINGS = {
    "standard": ReasonWording(
        flags={
            "structuring": "{n} cash deposits between 9,000 and 9,999.99 suggest structuring to avoid the reporting "
            "threshold",
            "rapid_movement": "an incoming wire was moved onward within two days (rapid movement of funds)",
            "high_risk_jurisdiction": "wires involve a high-risk jurisdiction ({countries})",
            "sanctions_near_match": "the customer's name is a {score} near-match to a sanctions list entry",
        },
        confirmed_match="the customer's name is a {score} match to a sanctions list entry",
        no_flags="no red flags; the activity is consistent with the customer's profile",
    ),
    "quoted": ReasonWording(
        flags={
            "structuring": "{n} cash deposits of {amounts} just under the reporting threshold",
            "rapid_movement": "incoming wire of {wire_amount} on {wire_date} sent onward within two days",
            "high_risk_jurisdiction": "wire activity with {countries}",
            "sanctions_near_match": "screening hit at {score}",
        },
        confirmed_match="screening hit at {score}, treated as a confirmed sanctions match",
        no_flags="no red flags found; activity fits the client profile",
    ),
    "labelled": ReasonWording(
        flags={
            "structuring": "structuring ({n} cash deposits just under the threshold)",
            "rapid_movement": "rapid movement ({wire_amount} received {wire_date} and wired out within two days)",
            "high_risk_jurisdiction": "high-risk jurisdiction ({countries})",
            "sanctions_near_match": "sanctions near-match (similarity {score})",
        },
        confirmed_match="sanctions match (similarity {score})",
        no_flags="none of the red flags applies",
        separator=", ",
    ),
}

NUMBER_FORMATS = {
    "us": NumberFormat(),
    "plain": NumberFormat(thousands="", currency_first=True, percent_scores=True),
    "european": NumberFormat(thousands=".", decimal=",", currency="EUR"),
}
DATE_FORMATS = ("%Y-%m-%d", "%d %b %Y", "%m/%d/%Y")

STANDARD = Style(
    "standard", WORDINGS["standard"], HEADER_FIELDS, NUMBER_FORMATS["us"], "%Y-%m-%d", REASON_WORDINGS["standard"]
)
VARIANTS = {
    "standard": STANDARD,
    "ledger": Style(
        "ledger",
        WORDINGS["ledger"],
        ("alert", "sanctions", "customer", "account"),
        NUMBER_FORMATS["plain"],
        "%d %b %Y",
        REASON_WORDINGS["quoted"],
    ),
    "memo": Style(
        "memo",
        WORDINGS["memo"],
        ("account", "customer", "sanctions", "alert"),
        NUMBER_FORMATS["european"],
        "%m/%d/%Y",
        REASON_WORDINGS["labelled"],
    ),
}


def style_from_seed(seed: int) -> Style:
    """A style whose every part (wording, header order, number and date formats, reasons) is drawn at random."""
    rng = random.Random(f"style-{seed}")
    header_order = list(HEADER_FIELDS)
    rng.shuffle(header_order)
    return Style(
        f"seed-{seed}",
        WORDINGS[rng.choice(sorted(WORDINGS))],
        tuple(header_order),
        NUMBER_FORMATS[rng.choice(sorted(NUMBER_FORMATS))],
        rng.choice(DATE_FORMATS),
        REASON_WORDINGS[rng.choice(sorted(REASON_WORDINGS))],
    )


def get_style(variant: str | int) -> Style:
    """A style by variant name, or drawn from an integer seed (also given as a string of digits)."""
    if isinstance(variant, int) or (isinstance(variant, str) and variant.isdigit()):
        return style_from_seed(int(variant))
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: choose {', '.join(VARIANTS)} or an integer seed")
    return VARIANTS[variant]


def with_reasons_of(style: Style, other: Style) -> Style:
    """`style`'s case file with `other`'s reason wording: held-out cases in a layout a model was not trained on,
    answered as it was trained to answer."""
    return replace(style, name=f"{style.name}+{other.name}-reasons", reasons=other.reasons)
