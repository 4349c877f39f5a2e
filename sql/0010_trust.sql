-- Trust: the tables behind the clock rule, the function set and the role model.
--
-- From this migration on, the functions' current definitions live in
-- sql/functions/*.sql. The migrator re-applies them with CREATE OR REPLACE
-- after the ordered migrations whenever their text changed (recorded in
-- schema_functions), so no migration copies a function body any more.

-- Per-schema settings only the schema owner can change (no other role gets
-- UPDATE on it). `test_clock`: whether the functions honour a caller's
-- `p_now`. Off by default: expiry is then judged by clock_timestamp() alone,
-- whatever a client sends. Test fixtures turn it on for their own schemas.
CREATE TABLE @schema@.settings (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    test_clock  boolean NOT NULL DEFAULT false
);
INSERT INTO @schema@.settings DEFAULT VALUES;

-- The checksum of the function set last applied from sql/functions.
CREATE TABLE @schema@.schema_functions (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Roles granted a pglease role (client or reader) on this schema, so that an
-- upgrade that adds a function grants it to them again.
CREATE TABLE @schema@.role_grants (
    role_name   name PRIMARY KEY,
    kind        text NOT NULL CHECK (kind IN ('client', 'reader')),
    granted_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Functions are EXECUTE-able by PUBLIC when created; the function step
-- revokes that again after every apply. Tables were never PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA @schema@ FROM PUBLIC;
