"""Connecting to a history database and bringing its schema to this canaryd's revision.

Kept apart from the reads and writes because three callers need it without a `Store`: the Alembic
environment (``migrations/env.py``), ``canaryd db upgrade``/``db current``, and the tests of the
migrations. One way builds the schema: the Alembic revisions in ``migrations/versions``, from the empty
database up, on SQLite and PostgreSQL alike. Every `Store` runs them first (the daemon before READY=1).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from sqlalchemy import event, inspect
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlmodel import Session, SQLModel, create_engine

from canaryd.errors import InputError
from canaryd.files import DIR_MODE, FILE_MODE
from canaryd.store.cache import Cache

MIGRATIONS = Path(__file__).with_name("migrations")
SCHEMA_REVISION = "0009"  # the head revision (tests/unit/test_migrations.py checks it against the scripts)
TABLES = frozenset(
    {"run", "stack", "payload", "request", "outcome", "event", "observation", "baseline", "keep"}
)
_PG_MIGRATION_LOCK = 0x63616E61727964  # "canaryd": one migrator at a time per PostgreSQL database


class SchemaMismatch(SQLAlchemyError):
    """The database predates migrations, or a newer canaryd migrated it (exit 4, one line)."""


class StorageUnusable(InputError):
    """The database cannot be used as configured (exit 2, like any config problem): its directory or file
    cannot be created (``path``), or the URL names no database canaryd can open. `canaryd.store.open_store`
    names the config key (``state_dir`` or ``storage.url``)."""

    def __init__(self, why: str, path: Path | None = None) -> None:
        super().__init__(f"cannot create {path}: {why}" if path is not None else why)
        self.why, self.path = why, path


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the prober
    cur.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; a crash loses at most the last commit
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


class _SharedCompiled:
    """SQLAlchemy's compiled-statement cache, one for the process, shared by every engine `make_engine`
    makes.

    An engine keeps its own cache, keyed by its dialect object, so each new engine (a `Store` per
    ``canaryd check`` pass, or per command) compiled every statement again: about as much CPU as the pass's
    probes. Here the dialect in the key is replaced by the engine's *equivalence*: its dialect class and
    its full URL. Equal URLs are the same database server, and `make_engine` builds equal URLs with equal
    options, so their dialects compile a statement alike; a statement compiled on one engine is reused by
    the next. Engines `make_engine` did not make keep their own dialect in the key (nothing is shared).
    """

    def __init__(self, size: int = 1000) -> None:
        from sqlalchemy.util import LRUCache

        self._lru: LRUCache = LRUCache(size)
        self._equivalent: dict[int, tuple] = {}  # id(dialect) → its equivalence (the dialect is kept alive)
        self._lock = threading.Lock()

    def register(self, engine: Engine) -> None:
        key = (type(engine.dialect), engine.url.render_as_string(hide_password=False))
        with self._lock:
            if len(self._equivalent) >= 256:  # many databases in one process (tests): start over
                self._equivalent.clear()
            self._equivalent[id(engine.dialect)] = (engine.dialect, key)

    def _key(self, key: tuple) -> tuple:
        hit = self._equivalent.get(id(key[0]))
        return (hit[1], *key[1:]) if hit is not None and hit[0] is key[0] else key

    def get(self, key: tuple, default=None):
        return self._lru.get(self._key(key), default)

    def __setitem__(self, key: tuple, value) -> None:
        self._lru[self._key(key)] = value

    def __getitem__(self, key: tuple):
        return self._lru[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and bool(key) and self._key(key) in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        self._lru.clear()


COMPILED = _SharedCompiled()


def make_engine(url: str) -> Engine:
    """An engine for a history database, without touching its schema (``migrate`` does that).

    A SQLite file's directory is created private (0700); a URL canaryd cannot use is `StorageUnusable`.
    Its compiled statements are shared with every other engine on an equal URL (`COMPILED`).
    """
    engine = _make_engine(url)
    COMPILED.register(engine)
    engine.update_execution_options(compiled_cache=COMPILED)
    return engine


def _make_engine(url: str) -> Engine:
    try:
        u = make_url(url)
    except ArgumentError as e:
        raise StorageUnusable(str(e)) from None
    if u.drivername == "postgresql":  # psycopg 3 (the `postgres` extra), not SQLAlchemy's psycopg2 default
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:" and not u.database.startswith("file:"):
            directory = Path(u.database).expanduser().parent
            try:
                directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            except OSError as e:
                raise StorageUnusable(e.strerror or str(e), directory) from None
        # Wait up to 30 s for another writer's lock (Python's default is 5 s); `?timeout=N` in the URL wins.
        engine = create_engine(u, connect_args={} if "timeout" in u.query else {"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if u.get_backend_name() == "postgresql":
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise InputError(
                f"storage url {u.render_as_string()}: PostgreSQL needs psycopg: "
                "pip install 'canaryd[postgres]'"
            ) from None
    try:
        return create_engine(u, pool_pre_ping=True)
    except (ArgumentError, ImportError) as e:  # an unknown scheme, or a dialect without its driver
        raise StorageUnusable(f"{e.__class__.__name__}: {e}") from None


def label(engine: Engine) -> str:
    """The database as a log line or an error message may name it (no password)."""
    return engine.url.render_as_string(hide_password=True)


class Connected:
    """What the store's write and read halves share: an engine, and a fresh session per call.

    A session per call keeps one `Store` safe to use from many threads; ``expire_on_commit=False`` lets
    a row read in one outlive its session.
    """

    engine: Engine
    _cache: Cache  # what passes read, held between them (`canaryd.store.cache`)

    @contextmanager
    def _session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s:
            yield s


def insert_of(s: Session, table: type[SQLModel]):
    """The dialect's INSERT, which has ``on_conflict_do_nothing``/``_do_update`` (SQLite and PostgreSQL)."""
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table.__table__)  # type: ignore[attr-defined]


def insert_ignore(s: Session, table: type[SQLModel], **values: object) -> bool:
    """Insert a row unless its key is already there; True if this call inserted it.

    ``INSERT ... ON CONFLICT DO NOTHING``: when several processes (a fleet on one PostgreSQL, or the daemon
    and a CLI on one SQLite file) store the same content at once, one row results and nobody fails. On
    PostgreSQL a concurrent inserter of the same key waits for the first transaction and then does nothing.
    Core statements on the session's connection (the ORM adds nothing here but time), one per dialect and
    table, built once: the values go as parameters (building a statement with them cost more than running it).
    """
    key = (s.get_bind().dialect.name, table.__tablename__)
    stmt = _INSERT_IGNORE.get(key)
    if stmt is None:
        stmt = _INSERT_IGNORE[key] = insert_of(s, table).on_conflict_do_nothing()
    return s.connection().execute(stmt, values).rowcount > 0


def insert_new(s: Session, table: type[SQLModel], **values: object) -> int | None:
    """`insert_ignore` of a row with an ``id``, returning it: None when the key was already there.

    One statement where a content key is usually new (an outcome: a probe's latency alone makes it new),
    instead of a look-up, the insert and a look-up of the id.
    """
    key = (s.get_bind().dialect.name, table.__tablename__, "id")
    stmt = _INSERT_IGNORE.get(key)
    if stmt is None:
        stmt = insert_of(s, table).on_conflict_do_nothing().returning(table.__table__.c.id)  # type: ignore[attr-defined]
        _INSERT_IGNORE[key] = stmt
    return s.connection().execute(stmt, values).scalar()


_INSERT_IGNORE: dict[tuple[str, ...], object] = {}


# -- Alembic: what autogenerate compares -----------------------------------------------------------------


def include_object(_obj, name, type_, _reflected, _compare_to) -> bool:
    """Autogenerate filter: ``observation`` is a view, written by hand in the revisions."""
    return not (type_ == "table" and name == "observation")


def _empty_string(sql: str | None) -> bool:
    while sql and sql.startswith("(") and sql.endswith(")"):
        sql = sql[1:-1]
    return sql is not None and sql.split("::")[0] in ("''", "")


def compare_server_default(
    _ctx, _conn_col, _meta_col, conn_default, _meta_default, meta_default
) -> bool | None:
    """Alembic's own comparison, except that it takes SQLite's ``''`` for a different default than ``""``."""
    if _empty_string(conn_default) and _empty_string(meta_default):
        return False
    return None


# What `alembic revision --autogenerate` and `alembic check` compare (env.py, tests/unit/test_migrations.py).
AUTOGENERATE_OPTIONS = {
    "include_object": include_object,
    "compare_type": True,
    "compare_server_default": compare_server_default,
}


# -- Alembic: running the migrations ---------------------------------------------------------------------


def alembic_config(connection: Connection | None = None, url: str | None = None):
    """Alembic's configuration, built in code: no alembic.ini is needed at run time."""
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def known_revisions() -> set[str]:
    """Every revision this canaryd's migrations know."""
    from alembic.script import ScriptDirectory

    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def _read_revision(engine: Engine, conn: Connection) -> str | None:
    """The database's revision; None for an empty one. A pre-migration database is a SchemaMismatch."""
    inspector = inspect(conn)
    names = set(inspector.get_table_names()) | set(inspector.get_view_names())
    rev = None
    if "alembic_version" in names:
        rev = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    if rev is None and names & TABLES:
        raise SchemaMismatch(
            f"{label(engine)}: written by an older canaryd, from before schema migrations "
            "(canaryd tables but no alembic_version): move the database aside"
        )
    return rev


def current_revision(engine: Engine) -> str | None:
    """The schema revision the database is at (None: empty), without changing anything."""
    if _new_sqlite_file(engine) is not None:
        return None  # connecting would create the file
    with engine.connect() as conn:
        if _at_head(conn):  # the common case, in one statement; anything else is read in full
            return SCHEMA_REVISION
        return _read_revision(engine, conn)


_HEAD = "SELECT version_num FROM alembic_version"


def _at_head(conn: Connection) -> bool:
    """Whether the database is at the head revision (False also when it has no ``alembic_version``, which
    `_read_revision` then looks into). Listing tables and views cost more than the rest of opening a store.
    """
    try:
        with conn.begin_nested() if conn.dialect.name == "postgresql" else nullcontext():
            return conn.exec_driver_sql(_HEAD).scalar() == SCHEMA_REVISION
    except SQLAlchemyError:
        return False


def migrate(engine: Engine) -> tuple[str | None, str]:
    """Bring the database to the head revision; (revision before, revision after).

    Cheap when nothing is to do (one query). Otherwise takes a lock first, so that several daemons starting
    on one database migrate it once: ``pg_advisory_xact_lock`` on PostgreSQL, ``BEGIN IMMEDIATE`` (the
    write lock) on SQLite; the migration runs inside that one transaction and is re-checked under the lock.
    A new SQLite file is built beside its path and linked into place whole, so that no reader ever finds
    the file without its schema.
    """
    path = _new_sqlite_file(engine)
    if path is not None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        try:  # created private before SQLite opens it; its -wal and -shm files take the same mode
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            os.fchmod(fd, FILE_MODE)
            os.close(fd)
        except OSError as e:
            raise StorageUnusable(e.strerror or str(e), path) from None
        fresh = make_engine(engine.url.set(database=str(tmp)).render_as_string(hide_password=False))
        try:
            _migrate(fresh)
            fresh.dispose()  # the last connection: the WAL is checkpointed into the file and removed
            try:
                os.link(tmp, path)  # atomic, and never over a database another process just created
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                if not path.exists():
                    os.replace(tmp, path)
        finally:
            fresh.dispose()
            for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
                leftover.unlink(missing_ok=True)
        _, after = _migrate(engine)
        return None, after
    return _migrate(engine)


def _new_sqlite_file(engine: Engine) -> Path | None:
    """The path of a SQLite database file that does not exist yet (None otherwise)."""
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:" or db.startswith("file:"):
        return None
    path = Path(db).expanduser()
    return None if path.exists() else path


def _migrate(engine: Engine) -> tuple[str | None, str]:
    try:
        before = current_revision(engine)
    except SchemaMismatch:  # read outside the lock: a migration may have committed between its queries
        before = None  # (tables listed before, views after); decided again under the lock
    if before == SCHEMA_REVISION:
        return before, before
    from alembic import command

    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        before = _read_revision(engine, conn)
        if before is not None and before not in known_revisions():
            raise SchemaMismatch(
                f"{label(engine)}: schema revision {before} is newer than this canaryd "
                f"(head {SCHEMA_REVISION}): upgrade canaryd"
            )
        if before != SCHEMA_REVISION:
            command.upgrade(alembic_config(conn), "head")
    return before, current_revision(engine) or ""


def upgrade(url: str) -> tuple[str, str | None, str]:
    """`canaryd db upgrade`: (the database without credentials, revision before, revision after)."""
    engine = make_engine(url)
    try:
        before, after = migrate(engine)
        return label(engine), before, after
    finally:
        engine.dispose()


def revision(url: str) -> str | None:
    """`canaryd db current`: the database's revision (None: empty), changing nothing."""
    engine = make_engine(url)
    try:
        return current_revision(engine)
    finally:
        engine.dispose()
