-- The expired-memory sweep moves behind a SECURITY DEFINER function (sweep_expired_memories, in
-- functions/memories.sql). The policies of 0003 let any
-- serving transaction that declared itself a sweep read other tenants' expired rows (and learn
-- their bucket ids); now only the owner, inside this function, can see or delete expired rows.
DROP POLICY memories_sweep ON tokensvc.memories;
DROP POLICY memories_sweep_read ON tokensvc.memories;
DO $$
BEGIN
    EXECUTE format(
        'CREATE POLICY memories_owner_sweep ON tokensvc.memories FOR DELETE TO %I '
        'USING (expires_at IS NOT NULL AND expires_at <= now())', current_user);
END $$;
