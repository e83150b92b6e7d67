"""jupyter_kernel_test against the installed gpu-magics kernelspec.

Every attribute that applies to a kernel that only answers magics is set; clear_output does
not apply (no magic clears output) and is left out.
"""

import jupyter_kernel_test as jkt
from kernel_client import HeartbeatSettled


class GpuMagicsKernelTests(jkt.KernelTests):
    kernel_name = "gpu-magics"
    language_name = "gpu-magics"
    file_extension = ".txt"

    code_hello_world = "%echo hello, world"
    code_stderr = "%echo --stderr something went wrong"

    completion_samples = [
        {"text": "%gpu", "matches": {"%gpuhelp", "%gpumem"}},
        {"text": "%gpumem --js", "matches": {"--json"}},
        {"text": "%gpuhelp gpum", "matches": {"gpumem"}},
    ]

    complete_code_samples = ["%gpumem", "%gpuhelp\n%gpumem --json", "# a note\n%gpuhelp"]
    incomplete_code_samples = ["%gpumem \\", "%gpumem --watch \\\n"]
    invalid_code_samples = ["print('hello')", "x = 1\n%gpumem"]

    code_page_something = "%gpumem?"
    code_generate_error = "%nosuchmagic"

    code_execute_result = [{"code": "%gpumem --json", "mime": "application/json"}]
    code_display_data = [
        {"code": "%gpuhelp", "mime": "text/html"},
        {"code": "%gpumem", "mime": "text/plain"},
    ]

    code_history_pattern = "%gpumem --js*"
    supported_history_operations = ("tail", "range", "search")

    code_inspect_sample = "%gpumem"


class GpuMagicsIopubWelcome(HeartbeatSettled, jkt.IopubWelcomeTests):
    kernel_name = "gpu-magics"
    support_iopub_welcome = True
