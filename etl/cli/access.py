"""``etl analyst`` (who may read which tenant, PostgreSQL) and ``etl tenant purge``."""

from __future__ import annotations

from typing import Annotated

import typer
from sqlalchemy import Engine, delete, select, text
from sqlalchemy.engine import make_url

from etl.cli.support import DbOption, existing_engine, fail, go_ahead, out, safe_url, store_engine, table_of
from etl.settings import Settings

analyst_app = typer.Typer(no_args_is_help=True, help="Analysts' read access per tenant (PostgreSQL).")
tenant_app = typer.Typer(no_args_is_help=True, help="Tenants' data.")
RoleArg = Annotated[str, typer.Argument(help="The analyst's login (a PostgreSQL role).")]
TenantArg = Annotated[str, typer.Argument(help="The tenant.")]


def postgres_engine(db: str | None) -> tuple[Engine, str]:
    from etl.runtime.wiring import database_url  # noqa: PLC0415

    url = db or database_url(None, Settings())
    if make_url(url).get_backend_name() != "postgresql":
        fail(f"{safe_url(url)} is not PostgreSQL: analyst logins and grants need it (a SQLite file's readers read "
             "all of it)")
    return store_engine(url)


@analyst_app.command("init")
def analyst_init(db: DbOption = None) -> None:
    """Create the read-only group role etl_analyst (needs CREATEROLE) if missing, and grant it read
    access on every table with a tenant column and the views. Run it as the tables' owner."""
    from connectors.store.security import ANALYST_ROLE, AccessRefused, init_analysts, schema_usage_missing  # noqa: PLC0415

    engine, url = postgres_engine(db)
    try:
        with engine.begin() as conn:
            created = init_analysts(conn)
            schema = schema_usage_missing(conn)
    except AccessRefused as exc:
        fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"cannot grant read access on {safe_url(url)}: {str(exc).splitlines()[0]}; run it as the tables' owner")
    out.print(f"{ANALYST_ROLE} {'created' if created else 'exists'}; it may read every tenant table and view "
              f"(rows only of tenants granted with `etl analyst grant LOGIN TENANT`) in {safe_url(url)}")
    if schema:
        out.print(f'[yellow]the schema owner must still run: GRANT USAGE ON SCHEMA "{schema}" TO {ANALYST_ROLE};[/]')


@analyst_app.command("grant")
def analyst_grant(role: RoleArg, tenant: TenantArg, db: DbOption = None) -> None:
    """Let a login read one tenant's rows (again: a no-op)."""
    from connectors.store.security import ANALYST_ROLE, AccessRefused, check_login, is_analyst  # noqa: PLC0415
    from connectors.store.tables import analyst_grants as g  # noqa: PLC0415
    from connectors.store.write import upsert  # noqa: PLC0415
    from etl.runtime.decode import MAX_TENANT  # noqa: PLC0415
    from etl.storable import text_problem  # noqa: PLC0415

    problem = text_problem(tenant) or (f"is longer than {MAX_TENANT} characters" if len(tenant) > MAX_TENANT else None)
    if not tenant.strip():  # '' is the tenant of dead letters whose message named none: no one's to read
        problem = "is blank; give a tenant's name"
    if problem:
        fail(f"the tenant {problem}")
    engine, _ = postgres_engine(db)
    try:
        with engine.begin() as conn:
            check_login(conn, role)
            upsert(conn, g, [{"role": role, "tenant": tenant}], ("role", "tenant"), None)
            member = is_analyst(conn, role)
    except AccessRefused as exc:
        fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"cannot grant: {type(exc).__name__}: {str(exc).splitlines()[0]}; run it as the tables' owner")
    out.print(f"{role} may read {tenant}")
    if not member:
        out.print(f"[yellow]{role} is not in {ANALYST_ROLE} and cannot read any table yet: "
                  f"GRANT {ANALYST_ROLE} TO \"{role}\"; (after `etl analyst init`)[/]")


@analyst_app.command("revoke")
def analyst_revoke(role: RoleArg, tenant: TenantArg, db: DbOption = None) -> None:
    """Stop a login reading a tenant (its open transactions keep their snapshot until they end)."""
    from connectors.store.tables import analyst_grants as g  # noqa: PLC0415

    engine, _ = postgres_engine(db)
    with engine.begin() as conn:
        gone = conn.execute(delete(g).where(g.c.role == role, g.c.tenant == tenant)).rowcount
    out.print(f"{role} may no longer read {tenant}" if gone else f"{role} had no grant for {tenant}")


@analyst_app.command("list")
def analyst_list(role: Annotated[str | None, typer.Argument(help="Only this login.")] = None,
                 db: DbOption = None) -> None:
    """Who may read which tenant."""
    from connectors.store.tables import analyst_grants as g  # noqa: PLC0415

    engine, _ = postgres_engine(db)
    query = select(g.c.role, g.c.tenant, g.c.created_at).order_by(g.c.role, g.c.tenant)
    with engine.connect() as conn:
        roles = set(conn.execute(text("SELECT rolname FROM pg_roles")).scalars())
        rows = [{"login": r.role, "tenant": r.tenant, "granted": str(r.created_at)[:19],
                 # a grant outlives its role: a new role of the same name would read with it
                 "note": "" if r.role in roles else "role dropped: revoke this grant"}
                for r in conn.execute(query.where(g.c.role == role) if role else query)]
    out.print(table_of("Analyst grants", rows) if rows else "no grants")


@tenant_app.command("purge")
def tenant_purge(tenant: TenantArg,
                 dry_run: Annotated[bool, typer.Option("--dry-run", help="Count the rows; delete nothing.")] = False,
                 yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
                 db: DbOption = None) -> None:
    """Delete every row of TENANT in one transaction: documents, results, typed rows, cache, calls,
    dead letters with their payloads, review items, golden examples, evals, alerts, grants. Stop
    the tenant's pipelines first: what they write after the purge stays."""
    from connectors.store.purge import purge_tenant, untenanted_letters  # noqa: PLC0415
    from etl.runtime.wiring import database_url  # noqa: PLC0415

    if not tenant.strip():  # '' holds the dead letters whose message named no tenant: no tenant's rows
        fail("the tenant is blank; give a tenant's name")
    url = db or database_url(None, Settings())
    engine = existing_engine(url, "purge")  # not migrated: counting and deleting change no schema
    try:
        counts = purge_tenant(engine, tenant, dry_run=True)
        untenanted = untenanted_letters(engine)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"cannot count {tenant!r}'s rows: {type(exc).__name__}: {str(exc).splitlines()[0]}; "
             "run it as the tables' owner")
    total = sum(counts.values())
    out.print(table_of(f"{tenant!r} in {safe_url(url)}: {total} row(s)",
                       [{"table": t, "rows": n} for t, n in counts.items()]))
    if untenanted:
        out.print(f"{untenanted} dead letter(s) have no tenant (unreadable input) and are not counted: "
                  "see `etl dlq list --reason bad_input`")
    if not go_ahead(total, dry_run=dry_run, yes=yes, question=f"delete these {total} row(s) of {tenant!r}?"):
        return
    try:
        deleted = purge_tenant(engine, tenant, dry_run=False)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"nothing deleted: {type(exc).__name__}: {str(exc).splitlines()[0]}; run it as the tables' owner")
    out.print(f"deleted {sum(deleted.values())} row(s) of {tenant!r}; the dead-letter topic keeps its copies "
              "until its retention ends")


def register(app: typer.Typer) -> None:
    app.add_typer(analyst_app, name="analyst")
    app.add_typer(tenant_app, name="tenant")
