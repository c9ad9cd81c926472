"""Quality: golden-set evals, drift detection, and the HTML quality report."""
