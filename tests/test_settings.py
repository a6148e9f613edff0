"""Settings: precedence, validation, and errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokensvc.settings import SettingsError
from tokensvc.settings_sources import load_settings


def test_defaults_are_valid_and_embedded() -> None:
    settings = load_settings(environ={})
    assert settings.embedded_database
    assert settings.listen_address == "127.0.0.1:50051"


def test_environment_overrides_the_config_file_and_flags_override_both(tmp_path: Path) -> None:
    config = tmp_path / "tokensvc.toml"
    config.write_text('pool_max_size = 7\nlog_level = "DEBUG"\n')
    settings = load_settings(
        config_file=config, environ={"TOKENSVC_POOL_MAX_SIZE": "9"}, overrides={"log_level": "ERROR"}
    )
    assert settings.pool_max_size == 9
    assert settings.log_level == "ERROR"


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"TOKENSVC_POOL_MAX_SIZE": "lots"}, "TOKENSVC_POOL_MAX_SIZE"),
        ({"TOKENSVC_REFLECTION": "maybe"}, "TOKENSVC_REFLECTION"),
        ({"TOKENSVC_LISTEN_ADDRESS": "nowhere"}, "listen_address"),
        ({"TOKENSVC_POOL_MIN_SIZE": "20", "TOKENSVC_POOL_MAX_SIZE": "5"}, "pool_min_size"),
        ({"TOKENSVC_ADMIN_SPIFFE_IDS": "admin@example.com"}, "admin_spiffe_ids"),
        ({"TOKENSVC_TYPO_SETTING": "1"}, "TOKENSVC_TYPO_SETTING"),
        ({"TOKENSVC_DATABASE_DSN": "postgresql://u:secret@db:5432/x"}, "database_dsn"),
        ({"TOKENSVC_DATABASE_DSN": "postgresql://db:5432/x"}, "database_credential_dir"),
        ({"TOKENSVC_LAUNCHER_SPIFFE_TEMPLATE": "spiffe://x/{agent}"}, "launcher_spiffe_template"),
        ({"TOKENSVC_MIGRATION_PARALLEL": "0"}, "migration_parallel"),
    ],
)
def test_bad_setting_gives_a_readable_error_naming_it(environ: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        load_settings(environ=environ)


def test_dsn_with_a_password_is_refused_without_echoing_it() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(environ={"TOKENSVC_DATABASE_DSN": "postgresql://u:hunter2@db/x"})
    assert "hunter2" not in str(caught.value)


def test_unknown_key_in_the_config_file_is_named(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("pool_max_sise = 3\n")
    with pytest.raises(SettingsError, match="pool_max_sise"):
        load_settings(config_file=config, environ={})


def test_serving_without_tls_files_is_refused() -> None:
    with pytest.raises(SettingsError, match="tls_cert_file"):
        load_settings(environ={}).require_tls_files()


def test_settings_repr_holds_no_secret_values(tmp_path: Path) -> None:
    secret_dir = tmp_path / "creds"
    secret_dir.mkdir()
    (secret_dir / "password").write_text("hunter2")
    settings = load_settings(environ={"TOKENSVC_DATABASE_CREDENTIAL_DIR": str(secret_dir)})
    assert "hunter2" not in repr(settings)
