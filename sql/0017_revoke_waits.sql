-- A revoked lease cannot be claimed before the revoked holder's last granted
-- expiry.
--
-- revoke_lease fences the holder at once (its renew, release and fenced
-- writes are refused), but it cannot stop the holder's process: a runner on
-- another host (`pglease hold`, `pglease elect -- CMD`) stops its command by
-- its own trust window, which closes before that expiry. Until then a claim
-- is refused as for a live lease, with `expires_at` = the time it frees.
-- NULL, or a time in the past, once nothing is waited for.
ALTER TABLE @schema@.leases ADD COLUMN revoked_until timestamptz;
