"""One module per resource; `api_router` gathers them."""

from fastapi import APIRouter

from server.api.routes import audit, files, health, keys, models

api_router = APIRouter()
for module in (health, models, files, keys, audit):
    api_router.include_router(module.router)
