"""OpenAI files: upload (streamed multipart), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from server.api.deps import DataDep, ListingScopeDep, OwnedFile, SessionDep, SettingsDep, set_audit_target
from server.api.schemas import FileDeleted, FileObject, ListResponse
from server.api.uploads import receive_multipart
from server.services import files as file_service
from server.services.storage import StreamedFile

router = APIRouter(prefix="/v1/files", tags=["files"])


# The body is parsed by hand (streamed to disk), so FastAPI cannot describe it: say what it is for clients and fuzzers.
UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"type": "string", "enum": list(file_service.SUPPORTED_PURPOSES)},
                },
            }
        }
    },
}


@router.post("", name="files.create", openapi_extra={"requestBody": UPLOAD_BODY})
async def create_file(request: Request, session: SessionDep, settings: SettingsDep, principal: DataDep) -> FileObject:
    upload = await receive_multipart(
        request,
        file_field="file",
        open_file=lambda: StreamedFile(settings.files_dir, settings.max_upload_bytes, settings.max_upload_line_bytes),
    )
    file = await run_in_threadpool(
        file_service.create_file,
        session,
        settings,
        upload.file,
        filename=upload.filename,
        purpose=upload.fields.get("purpose"),
        owner=principal,
    )
    set_audit_target(request, file.id)
    return FileObject.model_validate(file)


@router.get("", name="files.list")
def list_files(
    session: SessionDep,
    _: DataDep,
    scope: ListingScopeDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> ListResponse[FileObject]:
    files, has_more = file_service.list_files(session, scope, purpose=purpose, limit=limit, order=order, after=after)
    return ListResponse[FileObject](data=files, has_more=has_more)


@router.get("/{file_id}", name="files.get")
def get_file(file: OwnedFile) -> FileObject:
    return FileObject.model_validate(file)


@router.get("/{file_id}/content", name="files.content")
def get_file_content(file: OwnedFile, settings: SettingsDep) -> FileResponse:
    return FileResponse(
        file_service.content_path(settings, file), media_type="application/octet-stream", filename=file.filename
    )


@router.delete("/{file_id}", name="files.delete")
def delete_file(file: OwnedFile, session: SessionDep, settings: SettingsDep) -> FileDeleted:
    file_service.delete_file(session, settings, file)
    return FileDeleted(id=file.id)
