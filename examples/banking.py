"""Route bank customer messages: classify each into one of the 77 banking77 intents and, for
transfer and top-up problems, extract a summary and the amount. Run: etl run examples/banking.py"""

import json
from pathlib import Path

from pydantic import BaseModel, Field

from etl import Classify, Extract, Pipeline, label_in

DATA = Path(__file__).parent / "data"
INTENTS = json.loads((DATA / "banking77_categories.json").read_text())


class MoneyIssue(BaseModel):
    summary: str = Field(max_length=60, description="the problem in a few words")
    amount: float | None = Field(description="the amount of money mentioned, or null")


pipeline = Pipeline(
    name="banking",
    source=DATA / "banking77.jsonl",
    stages=[
        Classify(INTENTS, "Classify the bank customer's message by its intent.", name="intent"),
        Extract(MoneyIssue, "Summarise the customer's problem with moving money.",
                when=label_in("intent", *[i for i in INTENTS if "transfer" in i or "top_up" in i])),
    ],
)
