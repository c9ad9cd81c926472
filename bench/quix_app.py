"""The pipeline of bench/pipeline.py written by hand in Quix Streams, as its documentation would:
one `Application` (consumer group, RocksDB state, exactly-once), a `StreamingDataFrame` whose
stateful `apply` looks the content's hash up in the message key's state, calls the model when it
is new, remembers the answer, and sends the result to an output topic.

The baseline of bench/run.py's `quix` section, run as its own process (an Application owns its
process's signal handlers):

    python -m bench.quix_app TOPIC GROUP STATE_DIR OUT.json [--median-s S --seed N --idle-s S]

OUT.json gets: messages seen, model calls, and the times (perf_counter) of the Application's
creation and of the first and the last message done. The fake model sleeps a lognormal
latency (median --median-s, sigma 0.5, seeded) and answers a label: the same model as
idem-etl's FakeLLM(latency_s=lognormal(...)) in the same section.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from quixstreams import Application, State

LABELS = ["billing", "technical", "account", "other"]
FINGERPRINT = "route-v1"  # the stage's prompt and model, as a hand-written app would version them


def main() -> None:
    args = argparse.ArgumentParser()
    for name in ("topic", "group", "state_dir", "out"):
        args.add_argument(name)
    args.add_argument("--median-s", type=float, default=0.0)
    args.add_argument("--seed", type=int, default=0)
    args.add_argument("--idle-s", type=float, default=3.0, help="stop after this long without a new message")
    opts = args.parse_args()
    rng = random.Random(opts.seed)
    seen = {"messages": 0, "calls": 0, "first": None, "last": None}

    def model(text: str) -> str:
        if opts.median_s:
            time.sleep(opts.median_s * math.exp(rng.gauss(0, 0.5)))
        return LABELS[int(hashlib.sha256(text.encode()).hexdigest(), 16) % len(LABELS)]

    def classify(ticket: dict[str, Any], state: State) -> dict[str, Any] | None:
        seen["messages"] += 1
        key = hashlib.sha256(f"{ticket['tenant']}\x00{FINGERPRINT}\x00{ticket['text']}".encode()).hexdigest()
        label = state.get(key)
        result = None
        if label is None:  # new content: ask the model and remember its answer
            label = model(ticket["text"])
            seen["calls"] += 1
            state.set(key, label)
            result = {"id": ticket["id"], "tenant": ticket["tenant"], "label": label}
        seen["last"] = time.perf_counter()
        seen["first"] = seen["first"] or seen["last"]
        return result

    started = time.perf_counter()
    app = Application(broker_address=os.environ["ETL_TEST_KAFKA"], consumer_group=opts.group,
                      auto_offset_reset="earliest", state_dir=opts.state_dir,
                      processing_guarantee="exactly-once", loglevel="WARNING")
    tickets = app.topic(opts.topic, value_deserializer="json")
    results = app.topic(f"{opts.topic}-quix-results", value_serializer="json")
    sdf = app.dataframe(tickets)
    sdf = sdf.apply(classify, stateful=True).filter(lambda result: result is not None)
    sdf.to_topic(results)
    app.run(timeout=opts.idle_s)  # stops once no message came for idle_s: the topic has been read to its end
    Path(opts.out).write_text(json.dumps({**seen, "started": started}))


if __name__ == "__main__":
    main()
