"""Extract company, date, address and total from scanned receipts (SROIE, OCR text) into a typed
``receipt`` table. Run: etl run examples/receipts.py"""

from pathlib import Path

from etl import Extract, Pipeline, Receipt

pipeline = Pipeline(
    name="receipts",
    source=Path(__file__).parent / "data" / "receipts.jsonl",
    stages=[Extract(Receipt, "Read the receipt and extract its key fields.", table="receipt")],
)
