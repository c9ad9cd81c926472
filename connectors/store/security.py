"""Analyst access on PostgreSQL: read-only logins that see the tenants the owner granted them.

Which tenants a login may read is data the owner controls: ``analyst_grants`` (role, tenant),
written by ``etl analyst grant`` as the owner. Every table with a tenant column has row-level
security with one policy, checking ``current_user`` against those grants; a session can narrow
what it sees with ``SET app.tenant = 'acme'`` but never widen it (the setting only ever adds a
condition). Views run with the caller's rights (``security_invoker``). Nothing an analyst can set
decides what she may read: ``current_user`` changes only through ``SET ROLE`` to a role she is a
member of, which reads with that role's grants (a group role has none).

Reviewers (``etl review serve``) are analysts who may also write verdicts: the group role
``etl_reviewer`` (a member of ``etl_analyst``, made by ``etl review init``) may update a review
item's verdict columns and add to or correct the golden set, only for the tenants granted to the
login, and only in its own name: the write policies check ``reviewer = current_user``.

The migrations need no cluster-wide rights: creating the group role ``etl_analyst`` is an admin's
step (``etl analyst init`` as a user with CREATEROLE, or ``CREATE ROLE etl_analyst NOLOGIN``), and
tables grant it read access whenever it exists — at creation, and once more by ``etl analyst init``.
"""

from __future__ import annotations

from sqlalchemy import Connection, text

ANALYST_ROLE = "etl_analyst"
REVIEWER_ROLE = "etl_reviewer"
#: What a reviewer may write: review items' verdict columns, golden examples' (by column).
REVIEW_UPDATES = ("status", "verdict", "corrected", "reviewer", "reviewed_at")
GOLDEN_INSERTS = ("pipeline", "tenant", "stage", "doc_key", "content", "expected", "origin", "reviewer", "reviewed_at")
GOLDEN_UPDATES = ("content", "expected", "origin", "reviewer", "reviewed_at")
GRANTS_TABLE = "analyst_grants"


class AccessRefused(ValueError):
    """A grant or setup step that cannot be made; the message says what to do instead."""


#: Rows a reader may see: a tenant granted to the current role, narrowed by ``app.tenant`` if set.
TENANT_POLICY = (
    f"tenant IN (SELECT g.tenant FROM {GRANTS_TABLE} AS g WHERE g.role = current_user::text) "
    "AND tenant = coalesce(nullif(current_setting('app.tenant', true), ''), tenant)"
)


def analyst_role_exists(conn: Connection) -> bool:
    return role_exists(conn, ANALYST_ROLE)


def protect_tenant_table(conn: Connection, table: str) -> None:
    """Row-level security on ``table`` by the grants; readable by the analyst role if it exists.
    The policy is for every role but the owner (who bypasses it), so no other login reads more."""
    name = _quoted(conn, table)
    conn.exec_driver_sql(f"ALTER TABLE {name} ENABLE ROW LEVEL SECURITY")
    conn.exec_driver_sql(f"DROP POLICY IF EXISTS tenant_isolation ON {name}")
    conn.exec_driver_sql(f"CREATE POLICY tenant_isolation ON {name} FOR SELECT USING ({TENANT_POLICY})")
    if analyst_role_exists(conn):
        conn.exec_driver_sql(f"GRANT SELECT ON {name} TO {ANALYST_ROLE}")


def protect_review_writes(conn: Connection) -> None:
    """Write policies for reviewers: a verdict or a golden example of a granted tenant, in the
    writer's own name (the owner, who bypasses the policies, writes as before)."""
    mine = f"({TENANT_POLICY}) AND reviewer = current_user::text"
    conn.exec_driver_sql("DROP POLICY IF EXISTS review_verdicts ON review_queue")
    conn.exec_driver_sql(f"CREATE POLICY review_verdicts ON review_queue FOR UPDATE USING ({TENANT_POLICY}) "
                         f"WITH CHECK ({mine} AND status = 'reviewed')")
    for command in ("INSERT", "UPDATE"):
        name = f"review_golden_{command.lower()}"
        conn.exec_driver_sql(f"DROP POLICY IF EXISTS {name} ON golden_examples")
        using = f" USING ({TENANT_POLICY})" if command == "UPDATE" else ""
        conn.exec_driver_sql(f"CREATE POLICY {name} ON golden_examples FOR {command}{using} "
                             f"WITH CHECK ({mine} AND origin = 'review')")


def role_exists(conn: Connection, role: str) -> bool:
    return conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first() is not None


def init_reviewers(conn: Connection) -> bool:
    """Creates the reviewer group role if missing (needs CREATEROLE), a member of the analyst role
    (made too, if missing), and grants it the review writes; returns whether it was created here."""
    init_analysts(conn)
    created = False
    if not role_exists(conn, REVIEWER_ROLE):
        conn.exec_driver_sql(f"CREATE ROLE {REVIEWER_ROLE} NOLOGIN IN ROLE {ANALYST_ROLE}")
        created = True
    grant_review_writes(conn)
    return created


def grant_review_writes(conn: Connection) -> None:
    """The reviewer role's column grants (the tables' owner may make them; no cluster-wide right)."""
    conn.exec_driver_sql(f"GRANT UPDATE ({', '.join(REVIEW_UPDATES)}) ON review_queue TO {REVIEWER_ROLE}")
    conn.exec_driver_sql(f"GRANT INSERT ({', '.join(GOLDEN_INSERTS)}), UPDATE ({', '.join(GOLDEN_UPDATES)}) "
                         f"ON golden_examples TO {REVIEWER_ROLE}")
    sequence = conn.execute(text("SELECT pg_get_serial_sequence('golden_examples', 'id')")).scalar()
    if sequence:
        conn.exec_driver_sql(f"GRANT USAGE ON SEQUENCE {sequence} TO {REVIEWER_ROLE}")


def is_reviewer(conn: Connection, role: str) -> bool:
    """Whether ``role`` may sign in to the review page: a member of the reviewer group whose reads
    row-level security limits. Not the tables' owner nor a member of it, a superuser, or a role that
    bypasses row-level security: those see every tenant (they review with ``etl review import``)."""
    if not role_exists(conn, REVIEWER_ROLE):
        return False
    return bool(conn.execute(text(
        "SELECT pg_has_role(:r, :g, 'USAGE') AND NOT r.rolsuper AND NOT r.rolbypassrls "
        "AND NOT EXISTS (SELECT FROM pg_tables t WHERE t.tablename = 'review_queue' "
        "                AND t.schemaname = current_schema() AND pg_has_role(:r, t.tableowner, 'USAGE')) "
        "FROM pg_roles r WHERE r.rolname = :r"), {"r": role, "g": REVIEWER_ROLE}).scalar())


def protect_grants(conn: Connection) -> None:
    """Each login reads its own grants (the policies above read them with its rights), no others."""
    conn.exec_driver_sql(f"ALTER TABLE {GRANTS_TABLE} ENABLE ROW LEVEL SECURITY")
    conn.exec_driver_sql(f"DROP POLICY IF EXISTS own_grants ON {GRANTS_TABLE}")
    conn.exec_driver_sql(f"CREATE POLICY own_grants ON {GRANTS_TABLE} FOR SELECT USING (role = current_user::text)")


def protected_tables(conn: Connection) -> list[str]:
    """Tables of this schema under the tenant policy: the core ones and every typed table."""
    return list(conn.execute(text(
        "SELECT tablename FROM pg_policies WHERE schemaname = current_schema() AND policyname = 'tenant_isolation' "
        "ORDER BY tablename")).scalars())


def grant_reads(conn: Connection) -> list[str]:
    """Read access for the analyst role on every protected table, the views and its own grants;
    returns what was granted. Needs the role, and the tables' owner (or a superuser). The schema's
    USAGE is granted too where this user may grant it (``schema_usage_missing`` says if not)."""
    schema = conn.execute(text("SELECT current_schema()")).scalar_one()
    if schema_usage_missing(conn) and conn.execute(text(
            "SELECT pg_has_role(nspowner, 'USAGE') FROM pg_namespace WHERE nspname = :s"), {"s": schema}).scalar():
        conn.exec_driver_sql(f"GRANT USAGE ON SCHEMA {_quoted(conn, schema)} TO {ANALYST_ROLE}")
    # Only views that read with the caller's rights: any other view would read as its owner, past
    # the policies.
    views = list(conn.execute(text(
        "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relkind = 'v' AND c.reloptions @> ARRAY['security_invoker=true'] "
        "ORDER BY c.relname")).scalars())
    relations = [*protected_tables(conn), *views, GRANTS_TABLE]
    for relation in relations:
        conn.exec_driver_sql(f"GRANT SELECT ON {_quoted(conn, relation)} TO {ANALYST_ROLE}")
    return relations


def schema_usage_missing(conn: Connection) -> str | None:
    """The schema the analyst role cannot use yet (its owner must grant it), or None."""
    schema = str(conn.execute(text("SELECT current_schema()")).scalar_one())
    usable = conn.execute(text("SELECT has_schema_privilege(:r, :s, 'USAGE')"), {"r": ANALYST_ROLE, "s": schema}).scalar()
    return None if usable else schema


def init_analysts(conn: Connection) -> bool:
    """Creates the analyst group role if missing (needs CREATEROLE) and grants it read access;
    returns whether the role was created here."""
    created = False
    if not analyst_role_exists(conn):
        can = conn.execute(text("SELECT rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user")).scalar()
        if not can:
            raise AccessRefused(
                f"{current_role(conn)} may not create roles: run `CREATE ROLE {ANALYST_ROLE} NOLOGIN;` as an admin, "
                "then `etl analyst init` again")
        conn.exec_driver_sql(f"CREATE ROLE {ANALYST_ROLE} NOLOGIN")
        created = True
    grant_reads(conn)
    return created


def _quoted(conn: Connection, name: str) -> str:
    return str(conn.dialect.identifier_preparer.quote_identifier(name))


def current_role(conn: Connection) -> str:
    return str(conn.execute(text("SELECT current_user")).scalar_one())


def check_login(conn: Connection, role: str) -> None:
    """Refuses a grant nobody could use: a role that does not exist, or the group role itself
    (whose grants only a ``SET ROLE etl_analyst`` would read)."""
    if role == ANALYST_ROLE:
        raise AccessRefused(f"grant tenants to analysts' logins, not to the group role {ANALYST_ROLE}")
    can_login = conn.execute(text("SELECT rolcanlogin FROM pg_roles WHERE rolname = :r"), {"r": role}).scalar()
    if can_login is None:
        raise AccessRefused(f"role {role!r} does not exist: create it first "
                          f"(CREATE ROLE \"{role}\" LOGIN PASSWORD '...' IN ROLE {ANALYST_ROLE};)")
    if not can_login:
        raise AccessRefused(f"role {role!r} cannot log in: grant tenants to logins (policies check the "
                            "current role, so a group's grants would count only after SET ROLE)")


def is_analyst(conn: Connection, role: str) -> bool:
    """Whether ``role`` can read through the analyst group (member of it, directly or not)."""
    if not analyst_role_exists(conn):
        return False
    return bool(conn.execute(text("SELECT pg_has_role(:r, :g, 'USAGE')"), {"r": role, "g": ANALYST_ROLE}).scalar())
