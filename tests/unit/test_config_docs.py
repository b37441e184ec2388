"""docs/configuration.md is what `python -m rlmega.config.docs` makes of the schema today (rlmega/config/docs.py)."""

import dataclasses

from rlmega.config import docs
from rlmega.config.schema import DataConfig, RLConfig


def test_the_configuration_page_is_up_to_date():
    assert docs.PAGE.is_file(), (
        f"{docs.PAGE} is missing. Fix: run {docs.COMMAND} and commit the page"
    )
    assert docs.PAGE.read_text() == docs.render(), (
        f"{docs.PAGE} is stale: the schema's fields or docstrings (rlmega/config/schema.py) changed since it was "
        f"written. Fix: run {docs.COMMAND} and commit docs/configuration.md"
    )


def test_every_field_has_a_docstring():
    assert docs.undocumented() == [], (
        "these schema fields have no docstring (a string literal under the field), "
        "so the configuration page cannot say what they do"
    )


def test_the_page_shows_each_fields_type_default_and_docstring():
    text = docs.render()
    for section in ("trainer", "rollout", "agent_loop.judgers[]", "tasks[]"):
        assert f"\n## {section}\n" in text
    assert "- **`total_steps`** (`int`, default `" in text
    # a docstring's lines are joined into one Markdown line; a Literal shows its choices
    assert (
        "- **`dtype`** (`Literal['float32', 'bfloat16']`, default `\"float32\"`): Parameter and compute"
        in text
    )
    n_fields = sum(len(dataclasses.fields(c)) for _, c, _ in docs._sections())
    assert text.count("\n- **`") == n_fields
    assert docs.field_docs(DataConfig)["synthetic_size"][1].startswith(
        "Number of synthetic prompts"
    )
    assert "critic" in docs.field_docs(RLConfig)


def test_check_mode_names_the_command_when_stale(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text("old\n")
    assert docs.main(["--check", "--out", str(page)]) == 1
    assert docs.COMMAND in capsys.readouterr().err
    assert docs.main(["--out", str(page)]) == 0 and docs.main(["--check", "--out", str(page)]) == 0
