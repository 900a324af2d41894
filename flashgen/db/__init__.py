"""The tuning-log database: every measurement flashgen makes, kept append-only in SQLite."""

from flashgen.db.database import Database, default_db_path
from flashgen.db.record import STATUSES, Record

__all__ = ["STATUSES", "Database", "Record", "default_db_path"]
