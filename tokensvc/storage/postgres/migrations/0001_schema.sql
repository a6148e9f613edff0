-- The tokensvc schema, owned by the migrating role; the serving group role gets usage only.
-- {app_role} is substituted (a validated identifier) by the migration runner.
CREATE SCHEMA IF NOT EXISTS tokensvc;
GRANT USAGE ON SCHEMA tokensvc TO {app_role};
ALTER DEFAULT PRIVILEGES IN SCHEMA tokensvc
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {app_role};
ALTER DEFAULT PRIVILEGES IN SCHEMA tokensvc
    GRANT USAGE, SELECT ON SEQUENCES TO {app_role};
-- The serving role may read which schema version it runs against, and change nothing in it.
GRANT SELECT ON tokensvc.schema_migrations TO {app_role};
