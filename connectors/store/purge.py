"""Deleting a tenant: every row of it, in every table that has a tenant column, in one transaction."""

from __future__ import annotations

from sqlalchemy import Connection, Engine, inspect, text

from connectors.store.tables import NO_TENANT, TENANT_TABLES, analyst_grants, dead_letters, typed_table_names


def tenant_tables(conn: Connection) -> list[str]:
    """The store's tables holding tenant rows: every typed table, the core ones and the grants
    (PostgreSQL)."""
    names = set(inspect(conn).get_table_names())
    return [*typed_table_names(conn), *(t for t in (*TENANT_TABLES, analyst_grants.name) if t in names)]


def purge_tenant(engine: Engine, tenant: str, *, dry_run: bool) -> dict[str, int]:
    """Rows of ``tenant`` per table, deleted unless ``dry_run`` (then nothing changes): all in one
    transaction, so a failure deletes nothing."""
    counts: dict[str, int] = {}
    with engine.connect() as conn, conn.begin() as transaction:
        if conn.dialect.name == "postgresql":
            # A reader other than the owner would see (and delete) only what its policies show it,
            # and report the rest gone: fail instead.
            conn.exec_driver_sql("SET LOCAL row_security = off")
        quote = conn.dialect.identifier_preparer.quote
        for table in tenant_tables(conn):
            sql = (f"SELECT count(*) FROM {quote(table)} WHERE tenant = :t" if dry_run
                   else f"DELETE FROM {quote(table)} WHERE tenant = :t")
            result = conn.execute(text(sql), {"t": tenant})
            counts[table] = int(result.scalar_one()) if dry_run else int(result.rowcount)
        if dry_run:
            transaction.rollback()
    return counts


def untenanted_letters(engine: Engine) -> int:
    """Dead letters whose tenant could not be read from the message (bad input): no tenant's purge
    reaches them."""
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {dead_letters.name} WHERE tenant = :none"),
                                {"none": NO_TENANT}).scalar_one())
