"""One module per benchmark section, each with its ``*_figures`` function (see bench/run.py)."""
