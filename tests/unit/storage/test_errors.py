"""Driver failures become short fixed errors: the SQL and its parameters stay in the log."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from core.errors import StorageError, StorageUnavailable
from storage.base import storage_error

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
