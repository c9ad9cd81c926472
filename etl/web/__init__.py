"""``etl review serve``: the review queue in a browser (Starlette, Jinja2 templates, no build step)."""
