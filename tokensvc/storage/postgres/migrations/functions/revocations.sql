-- Capability revocations: every replica listening on the channel hears a new one at once.
--
-- Applied after the numbered migrations whenever this file changes (docs/development.md,
-- "Changing a SQL function"): each definition is the current one, in place.


-- Every revocation is announced when its transaction commits (NOTIFY is delivered at commit, never
-- before), so a replica that listens learns of it at once, however long after its `revoked_at` the
-- commit comes. Polling and the periodic full resync stay as the fallback.
CREATE OR REPLACE FUNCTION tokensvc.announce_revocation() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, tokensvc, public, pg_temp AS $$
BEGIN
    PERFORM pg_notify('tokensvc_revocations', json_build_object('kind', NEW.kind, 'value', NEW.value,
                      'revoked_at', NEW.revoked_at)::text);
    RETURN NULL;
END $$;

-- Created when missing, never replaced: on Citus a trigger's DDL on a placed table goes to the
-- workers only from inside a DO block. To change it, a numbered migration drops it (in a DO block)
-- and this file, applied after, creates it anew (docs/development.md).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'tokensvc.capability_revocations'::regclass
                   AND tgname = 'capability_revocations_announce') THEN
        CREATE TRIGGER capability_revocations_announce AFTER INSERT ON tokensvc.capability_revocations
            FOR EACH ROW EXECUTE FUNCTION tokensvc.announce_revocation();
    END IF;
END $$;
