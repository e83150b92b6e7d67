"""jupyter_kernel_test against gpu-python (gpukernel in front of ipykernel), with the attribute
set of ipykernel's own test file, plus samples that go through our magics."""

import jupyter_kernel_test as jkt
from kernel_client import HeartbeatSettled


class GpuPythonKernelTests(jkt.KernelTests):
    kernel_name = "gpu-python"
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"

    completion_samples = [
        {"text": "zip", "matches": {"zip"}},
        # Ours and IPython's own magics, merged.
        {"text": "%gpume", "matches": {"%gpumem"}},
        {"text": "%gpumem --wa", "matches": {"--watch"}},
    ]

    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n", "%gpumem"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]

    code_page_something = "zip?"
    code_generate_error = "raise"

    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
         "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math('\\frac{1}{2}'))",
         "mime": "text/latex"},
        {"code": "%gpuhelp", "mime": "text/html"},
    ]

    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")

    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"


class GpuPythonMagicsThroughProxy(jkt.KernelTests):
    """The same suite's checks on cells that gpukernel answers itself."""

    kernel_name = "gpu-python"
    code_hello_world = "%echo hello, world"
    code_stderr = "%echo --stderr oops"
    code_page_something = "%gpumem?"
    code_generate_error = "%gpumem --no-such-flag"
    code_execute_result = [{"code": "%gpumem --json", "mime": "application/json"}]
    code_inspect_sample = "%gpumem"


class GpuPythonIopubWelcome(HeartbeatSettled, jkt.IopubWelcomeTests):
    kernel_name = "gpu-python"
    support_iopub_welcome = True
