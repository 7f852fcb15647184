"""Response bodies. The OpenAI ones mirror OpenAI's objects field for field, so the official client parses them."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from server.db.models import ApiKey, AuditLog, File, Role

T = TypeVar("T")


def unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


class ListResponse(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | int | None = None
    last_id: str | int | None = None
    has_more: bool = False


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None

    @classmethod
    def of(cls, file: File) -> FileObject:
        return cls(
            id=file.id,
            bytes=file.bytes,
            created_at=unix(file.created_at),
            filename=file.filename,
            purpose=file.purpose,
            status=file.status,
            status_details=file.status_details,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ApiKeyObject(BaseModel):
    id: str
    object: Literal["api_key"] = "api_key"
    name: str
    role: Role
    prefix: str
    created_at: int
    created_by: str | None
    last_used_at: int | None
    revoked_at: int | None

    @classmethod
    def of(cls, key: ApiKey) -> ApiKeyObject:
        return cls(
            id=key.id,
            name=key.name,
            role=Role(key.role),
            prefix=key.prefix,
            created_at=unix(key.created_at),
            created_by=key.created_by,
            last_used_at=unix(key.last_used_at),
            revoked_at=unix(key.revoked_at),
        )


class ApiKeyCreated(ApiKeyObject):
    secret: str = Field(description="The key itself. Shown only in this response; store it now.")


class ApiKeyCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    role: Role


class AuditEntry(BaseModel):
    id: int
    object: Literal["audit_log.entry"] = "audit_log.entry"
    created_at: int
    actor_key_id: str | None
    action: str
    method: str
    path: str
    target: str | None
    status_code: int
    outcome: str
    client_address: str | None

    @classmethod
    def of(cls, entry: AuditLog) -> AuditEntry:
        return cls(
            id=entry.id,
            created_at=unix(entry.created_at),
            actor_key_id=entry.actor_key_id,
            action=entry.action,
            method=entry.method,
            path=entry.path,
            target=entry.target,
            status_code=entry.status_code,
            outcome=entry.outcome,
            client_address=entry.client_address,
        )
