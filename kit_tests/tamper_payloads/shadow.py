"""A file next to the notebook named like a module the kernel or the grader imports (torch.py,
sitecustomize.py, adapters.py ...): if it ever runs, it leaves a marker file beside itself."""
import pathlib

pathlib.Path(__file__).with_name("SHADOW-RAN").write_text(__name__)
