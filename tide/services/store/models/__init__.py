"""The ORM schema, one module per service that owns the tables. The migrations
under tide/services/store/migrations are the source of truth; tests/store compares
these models against them."""
