"""The entry points: the `afd` command and everything that composes the services from above.

`afd/` is the core both services build on, `services/` are the three services, and this
package sits above both: the command line (main.py), the local cluster launcher (serve.py),
offline generation (generate.py), attention and FFN in one process (local.py) and the
benchmarks (bench/). Nothing in `afd/` or `services/` imports it.
"""
