"""Driver failures become short fixed errors: the SQL and its parameters stay in the log."""

from __future__ import annotations

import logging

import asyncpg
import pytest
import sqlalchemy as sa

from core.errors import StorageError, StorageUnavailable
from storage.outage import OutageLog, driver_errors, is_misconfigured, storage_error

STATEMENT = "INSERT INTO kg_messages (payload) VALUES (?)"
PARAMS = ("another client's secret payload",)


def test_an_unreachable_database_is_storage_unavailable_without_sql(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = storage_error(
        sa.exc.OperationalError(STATEMENT, PARAMS, ConnectionRefusedError("refused"))
    )
    assert isinstance(error, StorageUnavailable)
    assert error.message == "storage unavailable"
    assert "refused" in caplog.text and "secret" not in caplog.text


def test_a_refused_statement_is_a_storage_error_without_sql_or_parameters() -> None:
    error = storage_error(sa.exc.IntegrityError(STATEMENT, PARAMS, ValueError("duplicate key")))
    assert type(error) is StorageError
    assert error.message == "storage error"
    assert "INSERT" not in str(error) and "secret" not in str(error)


def test_an_os_error_means_the_database_is_unavailable() -> None:
    assert isinstance(storage_error(OSError("disk I/O error")), StorageUnavailable)


class _Refused(Exception):
    """A driver error as SQLAlchemy's asyncpg adapter gives it: with the SQLSTATE."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"server said {sqlstate}")
        self.sqlstate = sqlstate


def test_a_session_refused_while_connecting_is_storage_unavailable() -> None:
    """asyncpg raises its own error while connecting, not one of SQLAlchemy's: the store
    catches it (driver_errors) and it means the database cannot be reached."""
    refused = asyncpg.exceptions.ObjectNotInPrerequisiteStateError(
        'database "keygate" is not currently accepting connections'
    )
    assert isinstance(refused, driver_errors("postgresql"))
    assert isinstance(storage_error(refused), StorageUnavailable)
    starting = asyncpg.exceptions.CannotConnectNowError("the database system is starting up")
    assert isinstance(storage_error(starting), StorageUnavailable)


@pytest.mark.parametrize("sqlstate", ["57P01", "57P02", "57P03", "08006", "08003", "53300"])
def test_a_server_ending_or_refusing_sessions_is_storage_unavailable(sqlstate: str) -> None:
    error = sa.exc.DBAPIError(STATEMENT, PARAMS, _Refused(sqlstate))
    assert isinstance(storage_error(error), StorageUnavailable)


def test_a_statement_the_server_refused_by_sqlstate_is_a_storage_error() -> None:
    error = sa.exc.DBAPIError(STATEMENT, PARAMS, _Refused("23505"))
    assert type(storage_error(error)) is StorageError


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_logged_once_then_summarised_then_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    clock = _Clock()
    outage = OutageLog(logging.getLogger("keygate.storage"), interval=10.0, clock=clock)
    for _ in range(500):
        outage.unavailable("OperationalError: connection refused")
        clock.now += 0.01
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "connection refused" in caplog.records[0].getMessage()
    clock.now += 10.0
    outage.unavailable("OperationalError: connection refused")
    assert len(caplog.records) == 2
    assert "500 more" in caplog.records[1].getMessage()
    outage.answered()
    outage.answered()
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "INFO"]
    assert "answers again" in caplog.records[2].getMessage()
    outage.unavailable("OperationalError: connection refused")  # a new episode
    assert [r.levelname for r in caplog.records][-1] == "WARNING"
    assert len(caplog.records) == 4


@pytest.mark.parametrize(
    "refused",
    [
        asyncpg.exceptions.InvalidPasswordError('password authentication failed for user "kg"'),
        asyncpg.exceptions.InvalidAuthorizationSpecificationError('role "kg" does not exist'),
        asyncpg.exceptions.InvalidCatalogNameError('database "kg" does not exist'),
    ],
)
def test_a_session_refused_for_its_user_password_or_database_is_a_misconfiguration(
    refused: Exception,
) -> None:
    assert is_misconfigured(refused)
    assert is_misconfigured(sa.exc.DBAPIError(STATEMENT, PARAMS, refused))
    assert isinstance(storage_error(refused), StorageUnavailable)  # to clients, as an outage


def test_an_outage_that_is_a_misconfiguration_is_an_error_naming_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The password rotated under a running gateway: said as what it is, once, not as a
    'database unavailable' that waiting would end."""
    caplog.set_level(logging.INFO)
    clock = _Clock()
    outage = OutageLog(logging.getLogger("keygate.storage"), interval=10.0, clock=clock)
    # The writer thread's psycopg cannot tell why; asyncpg's next connection does.
    outage.unavailable("OperationalError: connection failed")
    for _ in range(100):
        outage.unavailable("InvalidPasswordError: password authentication", misconfigured=True)
        clock.now += 0.01
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
    assert "check the user, password and database" in caplog.records[1].getMessage()
    assert "InvalidPasswordError" in caplog.records[1].getMessage()
    clock.now += 10.0
    outage.unavailable("OperationalError: connection failed")
    assert "refusing the gateway's sessions for 11 s" in caplog.records[2].getMessage()
    outage.answered()
    outage.unavailable("InvalidPasswordError: password authentication", misconfigured=True)
    assert [r.levelname for r in caplog.records][-1] == "ERROR"  # a new episode, told again


def test_no_misconfiguration_without_a_sqlstate_saying_so() -> None:
    assert not is_misconfigured(sa.exc.DBAPIError(STATEMENT, PARAMS, _Refused("57P03")))
    assert not is_misconfigured(sa.exc.OperationalError(STATEMENT, PARAMS, OSError("refused")))
