"""Small record builders shared by the dataset tests."""

from __future__ import annotations


def chat(user="Summarise case 1.", answer="Disposition: CLOSE", **extra):
    return {
        "messages": [
            {"role": "system", "content": "You are an investigator."},
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer, **extra},
        ]
    }
