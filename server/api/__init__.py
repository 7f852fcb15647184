"""HTTP layer: routes, dependencies, middleware and error handlers. Routes call services; services touch the DB."""
