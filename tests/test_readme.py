"""The README as a user meets it: every Python block runs as written, every command names a make
target, config or example that exists, and every relative link of the README and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
#: what each Python block prints that shows it did its job (in the README's order)
PRINTS = [r"'lpa3/selected_fraction_epoch': 0\.[0-9]*[1-9]", r"^1\.0 10 authors$", None, None]


def test_the_readme_has_the_blocks_this_test_knows():
    assert len(PYTHON) == len(PRINTS), "a Python block was added or removed: update PRINTS"
    assert len(README.splitlines()) <= 250


@pytest.mark.parametrize("position", range(len(PRINTS)))
def test_each_python_block_runs_as_written(position, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # what a block writes (logs, checkpoints) lands here
    exec(compile(PYTHON[position], f"README.md python block {position}", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    if PRINTS[position] is not None:
        assert re.search(PRINTS[position], printed, flags=re.M), printed[-2000:]


def test_every_command_names_what_exists():
    make_targets = set(re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    commands = "\n".join(code for lang, code in BLOCKS if lang == "bash") + " ".join(re.findall(r"`[^`]+`", README))
    for target in re.findall(r"(?:^|`)make ([a-z]+)\b", commands, flags=re.M):
        assert target in make_targets, target
    for path in set(re.findall(r"\b((?:configs|examples|benchmarks|tests)/[\w/.-]+\.(?:yaml|py))\b", README)):
        assert (ROOT / path).is_file(), path


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_every_relative_link_resolves(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{doc}: {target}"


def test_the_resume_command_continues_the_runs_own_logs(tmp_path, monkeypatch):
    """The README's resume command, on a shortened demo: the resumed run writes into the interrupted
    run's log folder (the logger's version pinned), not into a second TensorBoard version beside it."""
    import shlex

    from lpa3_lightning.cli import main

    block = next(code for lang, code in BLOCKS if lang == "bash" and "--ckpt_path" in code)
    resume = shlex.split(block.replace("\\\n", " "))[2:]  # after `.venv/bin/lpa3 fit`
    resume = [str(ROOT / arg) if arg.startswith("configs/") else arg for arg in resume]  # (the repository's)
    at = resume.index("--ckpt_path")
    first = resume[:at] + resume[at + 2:]  # the interrupted run: the same command without the checkpoint
    # 2 batches: from the command line "1" reaches Lightning as 1.0, which it reads as the whole epoch
    short = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
             "--data.init_args.batch_size=8", "--test_after_fit=false"]
    monkeypatch.chdir(tmp_path)  # (the README's paths are relative: runs/...)
    main(["fit", *first, "--trainer.max_epochs=1", *short])
    main(["fit", *resume, "--trainer.max_epochs=2", *short])
    runs = tmp_path / "runs" / "demo_breastmnist_lpa3"
    assert sorted(p.name for p in runs.glob("version_*")) == ["version_0"]
    assert len(list((runs / "version_0").glob("events.out.tfevents.*"))) >= 1


def test_the_loop_without_lightning_runs_without_lightning_and_keeps_x_prime_in_the_datas_range(tmp_path):
    """The "Without Lightning" block in a process where Lightning cannot be imported (it imported
    IndexedDataset from lpa3_lightning.data, whose data modules import Lightning), and its x' stay in the
    data's box (the block called lpa3_attack without input_range: x' spanned [-1.17, 1.01] on [-1, 1] data)."""
    import subprocess
    import sys

    (block,) = [code for code in PYTHON if "lpa3_attack(" in code and "pl.Trainer" not in code]
    blocker = ("import sys\n"
               "class NoLightning:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric'):\n"
               "            raise ImportError(f'{name} is blocked: the loop must run without Lightning')\n"
               "sys.meta_path.insert(0, NoLightning())\n")
    check = "\nassert float(x_adv.min()) >= -1.0 and float(x_adv.max()) <= 1.0, (x_adv.min(), x_adv.max())\n"
    script = tmp_path / "loop.py"
    script.write_text(blocker + block + check)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
