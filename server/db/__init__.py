"""Database layer: SQLAlchemy models and sessions. The schema itself is made only by Alembic (`zaya db upgrade`)."""
