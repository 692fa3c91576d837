"""`recompile inspect` on a model whose forward fails: one line naming the failing module, exit code 2."""
import textwrap

from recompile import cli

BROKEN = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Broken(nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 4)
            self.tower = nn.Sequential(nn.ReLU(), Broken())

        def forward(self, x):
            return self.tower(self.head(x))


    def make():
        return Net(), (torch.randn(2, 4),)
''')


def test_inspect_of_a_failing_forward_prints_one_line_naming_the_module(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    assert cli.main(["inspect", f"{path}:make"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "fails in module 'tower.1' (Broken): RuntimeError: mat1 and mat2 shapes cannot be multiplied" in lines[0]
