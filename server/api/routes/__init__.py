"""One module per resource; `api_router` gathers them."""

from fastapi import APIRouter

from server.api.inference import routes as inference
from server.api.routes import admin_models, audit, files, fine_tuning, health, keys, models

api_router = APIRouter()
for module in (health, models, inference, files, fine_tuning, keys, audit, admin_models):
    api_router.include_router(module.router)
