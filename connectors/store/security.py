"""Analyst access on PostgreSQL: a read-only role that sees one tenant's rows at a time.

An analyst session says which tenant it is looking at with ``SET app.tenant = 'acme'``; every table
with a tenant column has a row-level security policy comparing against it, and the views run with
the caller's rights (``security_invoker``), so no table or view shows another tenant's rows.
Without ``app.tenant`` an analyst sees nothing.
"""

from __future__ import annotations

from sqlalchemy import Connection

ANALYST_ROLE = "etl_analyst"


def create_analyst_role(conn: Connection) -> None:
    """The NOLOGIN group role analysts' logins are granted (``GRANT etl_analyst TO alice``)."""
    conn.exec_driver_sql(
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{ANALYST_ROLE}') "
        f"THEN CREATE ROLE {ANALYST_ROLE} NOLOGIN; END IF; END $$"
    )
    conn.exec_driver_sql(f"GRANT USAGE ON SCHEMA {_schema(conn)} TO {ANALYST_ROLE}")


def protect_tenant_table(conn: Connection, table: str) -> None:
    """Row-level security by ``app.tenant`` on ``table``, readable by the analyst role."""
    conn.exec_driver_sql(f'ALTER TABLE "{table}" ENABLE ROW LEVEL SECURITY')
    conn.exec_driver_sql(f'DROP POLICY IF EXISTS tenant_isolation ON "{table}"')
    conn.exec_driver_sql(
        f'CREATE POLICY tenant_isolation ON "{table}" FOR SELECT TO {ANALYST_ROLE} '
        "USING (tenant = current_setting('app.tenant', true))"
    )
    conn.exec_driver_sql(f'GRANT SELECT ON "{table}" TO {ANALYST_ROLE}')


def grant_view(conn: Connection, view: str) -> None:
    conn.exec_driver_sql(f'GRANT SELECT ON "{view}" TO {ANALYST_ROLE}')


def _schema(conn: Connection) -> str:
    return str(conn.exec_driver_sql("SELECT current_schema()").scalar_one())
