import subprocess
import sys


def test_host_side_modules_do_not_import_jax():
    code = (
        "import sys\n"
        "import jaxcb.page_pool, jaxcb.scheduler, jaxcb.buckets, jaxcb.request, jaxcb.engine_config, jaxcb.engine\n"
        "import jaxcb.prefix_cache, jaxcb.memory_plan, jaxcb.bucket_plan, jaxcb.compile_cache\n"
        "import jaxcb.trace, jaxcb.simulate, jaxcb.cli_tools\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
