-- The runner's credential is rotated like the serving one (issue 35): its own alternating login
-- roles, and its own line of versions in the rotation journal. Rows written before this
-- migration are the serving credential's.
ALTER TABLE tokensvc.credential_rotations
    ADD COLUMN credential text NOT NULL DEFAULT 'serving' CHECK (credential IN ('serving', 'runner'));
DROP INDEX tokensvc.credential_rotations_open;
CREATE INDEX credential_rotations_open ON tokensvc.credential_rotations (credential, id)
    WHERE outcome = 'in_progress';
CREATE INDEX credential_rotations_versions ON tokensvc.credential_rotations (credential, version)
    WHERE version IS NOT NULL;
