"""Persistence shared by the scaler and the coordinator: the engine and unit of
work (``db``), the ORM schema of both services (``models``) and the Alembic
migrations that create it. Each service keeps its own repository on top of it."""
