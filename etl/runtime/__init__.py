"""The loop and what only it uses, along the data flow: decode (message → document), runner (poll,
dispatch, commit), execute (a document's stages), calls (the model, with retries and repairs),
peers (single-flight across workers), tracker (committable offsets), wiring (settings → runner)."""
