"""Fault injection, crash safety and load: the database going away, tokensvc SIGKILLed, many tenants."""
