"""Request and response bodies shared by the routes. The OpenAI ones mirror OpenAI's objects field for field, so the
official client parses them.

Every request body is a `RequestBody`: a field it does not declare is refused as OpenAI refuses it (400 "Unrecognized
request argument supplied"; `server.api.errors`). Objects that show a database row are `RowObject`s, read from the
ORM object's attributes (`FileObject.model_validate(file)`); `ListResponse` is every list's envelope.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from server.db.models import Role

T = TypeVar("T")


def _unix(moment: datetime | int | None) -> int | None:
    return int(moment.timestamp()) if isinstance(moment, datetime) else moment


# A moment as OpenAI's objects give it: Unix seconds (read from the database's datetimes).
UnixTime = Annotated[int, BeforeValidator(_unix)]


class RequestBody(BaseModel):
    """A request body: undeclared fields are refused, never ignored."""

    model_config = ConfigDict(extra="forbid")


class RowObject(BaseModel):
    """A response object read from a database row's attributes."""

    model_config = ConfigDict(from_attributes=True)


class ListResponse(BaseModel, Generic[T]):
    """OpenAI's list: a page of `data` (response objects, or rows they are read from), the ids at its ends and
    whether more follow (ask for them with `after=<last_id>`)."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | int | None = None
    last_id: str | int | None = None
    has_more: bool = False

    @model_validator(mode="after")
    def _name_the_ends(self) -> ListResponse[T]:
        if self.data and self.first_id is None and self.last_id is None:
            self.first_id, self.last_id = getattr(self.data[0], "id", None), getattr(self.data[-1], "id", None)
        return self


class FileObject(RowObject):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: UnixTime
    expires_at: UnixTime | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: UnixTime
    owned_by: str


class ApiKeyObject(RowObject):
    id: str
    object: Literal["api_key"] = "api_key"
    name: str
    role: Role
    prefix: str
    created_at: UnixTime
    created_by: str | None
    last_used_at: UnixTime | None
    revoked_at: UnixTime | None


class ApiKeyCreated(ApiKeyObject):
    secret: str = Field(description="The key itself. Shown only in this response; store it now.")


class ApiKeyCreate(RequestBody):
    name: str = Field(min_length=1, max_length=200)
    role: Role


class AuditEntry(RowObject):
    id: int
    object: Literal["audit_log.entry"] = "audit_log.entry"
    created_at: UnixTime
    actor_key_id: str | None
    action: str
    method: str
    path: str
    target: str | None
    status_code: int
    outcome: str
    client_address: str | None
