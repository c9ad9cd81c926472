"""Alembic environment: runs on the connection handed over by ``connectors.store.upgrade``."""

from alembic import context

from connectors.store.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
