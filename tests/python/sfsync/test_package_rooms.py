"""The Python package's rooms (issue 26, item 3), checked on its source:

* no module of python/sfsync reads or writes another object's private
  member (``obj._name`` where obj is not ``self``/``cls``/``super()``) or
  imports another module's private name, except the torch/ctypes internals
  listed in ALLOWED, each with its reason;
* every module is at most 500 lines, with no waiver (issue 44, item 5);
* GradientSync and SyncOptimizer never call each other: both call the
  WindowDriver (issue 44, item 2);
* the bucket and window states have one holder, the plugin: no module
  stores them (the WindowDriver asks sf_bucket_state / sf_window_state);
* the shard setting has one holder, the C context: no module stores it
  again (issue 44, item 1);
* SyncOptimizer sets no private attribute of torch.optim.Optimizer by hand
  and never swaps an inner optimizer's ``params`` in and out;
* every public name is importable from its 0.3 location and from its new
  one, and both are the same object;
* python/README.md's Layout names every module (the package map).
"""

import ast
import importlib.util  # noqa: F401 (importlib.util.find_spec below)
import os
import sys
import unittest

# This folder holds torch/ (the tests of sfsync.torch): off sys.path, or where no
# torch is installed `import torch` would find that folder (a namespace package).
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".")
               != os.path.realpath(os.path.dirname(os.path.abspath(__file__)))]
HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "..", "..", "python", "sfsync")
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "python"))

#: (module, the expression as written) -> why it must reach past the underscore.
ALLOWED = {
    ("torch/gradient_sync.py", "torch.autograd.Variable._execution_engine"):
        "queue_callback, the only way (1.13 and 2.x) to run code when a backward pass ends",
    ("torch/rendezvous.py", "dist.distributed_c10d._get_default_store"):
        "torch.distributed's default store: no public accessor in 1.13 or 2.x",
    ("torch/window_driver.py", "m._register_state_dict_hook"):
        "torch 1.13 has no public state_dict pre hook (2.x's public one is used there)",
    ("torch/clip.py", "torch._foreach_norm"):
        "the per-tensor norm torch 2.x's clip_grad_norm_ takes: the exact clip must take the same",
    ("_abi.py", "Stats._fields_"): "ctypes.Structure's own field list (its public protocol)",
    ("context.py", "Options._fields_"): "ctypes.Structure's own field list",
    ("loader.py", "dll._name"): "ctypes.CDLL's path: it has no public accessor",
    ("torch/explicit_windows.py", "lib._handle"):
        "ctypes.CDLL's dlopen handle (dlvsym of the private window state needs it): no accessor",
    # The binding's private marks, shared by the binding and its loader only.
    ("__init__.py", "from sfsync._abi import _ContextPtr"): "0.3 name test_binding.py reads",
    ("__init__.py", "from sfsync._abi import _ContextStruct"): "0.3 name, kept with _ContextPtr",
    ("__init__.py", "from sfsync._abi import _STATUS"): "0.3 name test_binding.py reads",
    ("loader.py", "from sfsync._abi import _STATUS"): "the sf_status mark of the prototypes",
    ("context.py", "from sfsync._abi import _ContextPtr"): "the opaque sf_context* type",
}

MAX_LINES = 500  # and no docstring waives it (issue 44, item 5)


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root):
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, root).replace(os.sep, "/"), path


def violations(root=PACKAGE):
    """Every private access of the rule, as (module, line, expression)."""
    found = []
    for rel, path in _modules(root):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and \
                        base.func.id == "super":
                    continue  # the own class's base: an override calling its parent
                text = "%s.%s" % (ast.unparse(base), node.attr)
                if (rel, text) not in ALLOWED:
                    found.append((rel, node.lineno, text))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sfsync"):
                for alias in node.names:
                    if _private(alias.name) and alias.name != "_install" and \
                            not (node.module == "sfsync" and alias.name == "_abi"):
                        text = "from %s import %s" % (node.module, alias.name)
                        if (rel, text) not in ALLOWED:
                            found.append((rel, node.lineno, text))
    return found



_STATE_NAMES = {"phase", "waited", "gathering", "whole"}
_STATE_NAMES |= {"_" + n for n in _STATE_NAMES}


def _state_copies(rel, tree):
    """Where a module stores a bucket or window state again (the names
    0.4's WindowDriver kept): assignments, and add/discard/clear calls."""
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and e.attr in _STATE_NAMES:
                    found.append("%s:%d assigns .%s" % (rel, node.lineno, e.attr))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("add", "discard", "clear", "update", "remove") and \
                isinstance(node.func.value, ast.Attribute) and \
                node.func.value.attr in _STATE_NAMES:
            found.append("%s:%d .%s.%s()" % (rel, node.lineno, node.func.value.attr,
                                             node.func.attr))
    return found

class Rooms(unittest.TestCase):
    def test_no_module_touches_anothers_private_members(self):
        found = violations()
        self.assertEqual(found, [], "private members used across objects/modules:\n" +
                         "\n".join("  %s:%d %s" % v for v in found))

    def test_every_allowed_exception_is_still_needed(self):
        """An entry of ALLOWED that no longer occurs is stale: remove it."""
        seen = set()
        for rel, path in _modules(PACKAGE):
            with open(path) as f:
                text = f.read()
            for (module, expr) in ALLOWED:
                if module == rel and (expr in text or expr.split(" import ")[-1] in text):
                    seen.add((module, expr))
        self.assertEqual(sorted(set(ALLOWED) - seen), [])

    def test_the_rule_catches_what_it_should(self):
        """The scan itself: a cross-object access, a private import, and the
        allowed forms (self, cls, super())."""
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "m.py"), "w") as f:
                f.write("from sfsync.torch.store import _gradient_view\n"
                        "class A:\n"
                        "    def f(self, other):\n"
                        "        self._x = other._y\n"
                        "        return super()._z(cls._w)\n")
            self.assertEqual([(v[1], v[2]) for v in violations(d)],
                             [(1, "from sfsync.torch.store import _gradient_view"),
                              (4, "other._y")])

    def test_modules_are_rooms_of_at_most_500_lines(self):
        long = []
        for rel, path in _modules(PACKAGE):
            with open(path) as f:
                text = f.read()
            n = text.count("\n")
            doc = ast.get_docstring(ast.parse(text)) or ""
            if n > MAX_LINES:
                long.append("%s (%d lines)" % (rel, n))
            # every module opens with what it is responsible for
            self.assertTrue(doc, "%s has no module docstring" % rel)
        self.assertEqual(long, [], "modules over %d lines (no waiver): %s"
                         % (MAX_LINES, ", ".join(long)))

    def test_only_host_window_counts_the_window(self):
        """One window object (sfsync/host_window.py) counts passes for every
        host face, and windows for the faces whose windows the plugin does not
        synchronize (DDPSync; GradientSync's are the plugin's to count): no
        other module increments a pass or window counter, or keeps a string
        phase."""
        counters = {"passes", "windows", "_passes", "_windows", "_next_accumulation",
                    "_phase"}
        found = []
        for rel, path in _modules(PACKAGE):
            if rel == "host_window.py":
                continue
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute) \
                        and node.target.attr in counters:
                    found.append("%s:%d %s +=" % (rel, node.lineno, node.target.attr))
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                        isinstance(node.value.value, str) and any(
                            isinstance(t, ast.Attribute) and t.attr == "_phase"
                            for t in node.targets):
                    found.append("%s:%d _phase = %r" % (rel, node.lineno, node.value.value))
        self.assertEqual(found, [])

    def test_the_shard_setting_has_one_holder(self):
        """The C context holds the shard layout (issue 44, item 1): no
        module stores it again (assigns an attribute ``sharded``,
        ``_sharded``, ``shard_optimizer`` or ``shard_layout``) or reads a
        stored copy by name (``getattr(obj, "_sharded")``); the readers are
        properties that ask the context (sfsync.Context.shard_layout)."""
        names = {"sharded", "_sharded", "shard_optimizer", "shard_layout"}
        found = []
        for rel, path in _modules(PACKAGE):
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                           else [])
                for t in targets:
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Attribute) and e.attr in names:
                            found.append("%s:%d assigns .%s" % (rel, node.lineno, e.attr))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                        node.func.id == "getattr" and len(node.args) > 1 and \
                        isinstance(node.args[1], ast.Constant) and node.args[1].value == "_sharded":
                    found.append("%s:%d getattr(..., '_sharded')" % (rel, node.lineno))
        self.assertEqual(found, [])

    def test_the_bucket_states_have_one_holder(self):
        """The plugin holds every bucket's state and the window's (issue 44,
        item 1: sf_bucket_state, sf_window_state): no module keeps them
        again, by assigning an attribute that named them in 0.4
        (``phase``, ``waited``, ``gathering``, ``whole``, with or without
        a leading underscore) or by adding to or clearing one; the driver
        asks ``Context.bucket_state`` / ``window_state`` instead."""
        found = []
        for rel, path in _modules(PACKAGE):
            with open(path) as f:
                found += _state_copies(rel, ast.parse(f.read()))
        self.assertEqual(found, [])
        # The rule sees what 0.4's driver did.
        old = "self.waited = set()\nself.gathering.add(b)\nself.phase, x = 1, 2\n"
        self.assertEqual(sorted(_state_copies("old.py", ast.parse(old))),
                         ["old.py:1 assigns .waited", "old.py:2 .gathering.add()",
                          "old.py:3 assigns .phase"])

    def test_gradient_sync_and_the_optimizer_never_call_each_other(self):
        """One driver (torch/window_driver.py) sequences the window's
        collectives; GradientSync and SyncOptimizer each call it (issue 44,
        item 2). The optimizer's modules never import gradient_sync nor name
        a ``sync``; GradientSync only builds its optimizer (sync.optimizer)
        and hands it back (sync_optimizer), never reading or calling
        anything of it; the driver imports neither."""
        def tree(rel):
            with open(os.path.join(PACKAGE, rel)) as f:
                return ast.parse(f.read())
        found = []
        for rel in ("torch/optim.py", "torch/optim_state.py", "torch/optim_load.py",
                    "torch/shard_map.py", "torch/window_driver.py"):
            for node in ast.walk(tree(rel)):
                if isinstance(node, ast.ImportFrom) and node.module in (
                        "sfsync.torch.gradient_sync", "sfsync.torch.optim") and \
                        not rel.startswith("torch/optim_"):
                    found.append("%s:%d imports %s" % (rel, node.lineno, node.module))
                if isinstance(node, ast.Name) and node.id in ("sync", "GradientSync"):
                    found.append("%s:%d names %s" % (rel, node.lineno, node.id))
        for node in ast.walk(tree("torch/window_driver.py")):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "sfsync.torch.optim"):
                found.append("torch/window_driver.py:%d imports %s" % (node.lineno, node.module))
        for node in ast.walk(tree("torch/gradient_sync.py")):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                    node.value.attr == "_optimizer":
                found.append("torch/gradient_sync.py:%d uses self._optimizer.%s"
                             % (node.lineno, node.attr))
        self.assertEqual(found, [])

    def test_sync_optimizer_sets_no_private_torch_attribute(self):
        """SyncOptimizer is built by torch.optim.Optimizer.__init__: neither
        it nor its state-dict object assigns an attribute torch's Optimizer
        keeps privately, and neither assigns a group's "params" (the old
        swap of param_groups in and out)."""
        try:
            import torch
        except ImportError:
            self.skipTest("no torch")
        torch_private = {k for k in vars(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))],
                                                         lr=0.1)) if k.startswith("_")}
        self.assertTrue(torch_private, "this torch's Optimizer keeps no private attribute?")
        for rel in ("torch/optim.py", "torch/optim_state.py"):
            with open(os.path.join(PACKAGE, rel)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                        node.func.id == "setattr":
                    self.fail("%s:%d: setattr() on an object" % (rel, node.lineno))
                for t in targets:
                    if isinstance(t, ast.Attribute):
                        self.assertNotIn(t.attr, torch_private,
                                         "%s:%d sets torch's %s" % (rel, t.lineno, t.attr))
                    if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant):
                        self.assertNotEqual(t.slice.value, "params",
                                            "%s:%d assigns a group's params" % (rel, t.lineno))


#: (0.3 location, name, where it lives now).
MOVED = [("sfsync.torch", n, m) for n, m in (
    ("GradientSync", "sfsync.torch.gradient_sync"), ("DDPSync", "sfsync.torch.ddp"),
    ("attach", "sfsync.torch.ddp"), ("ReplicaCheck", "sfsync.torch.verify"),
    ("ReplicaMismatchError", "sfsync.torch.verify"), ("make_context", "sfsync.torch.rendezvous"),
    ("sf_dtype", "sfsync.torch.store"), ("SET_TO_NONE_DEFAULT", "sfsync.torch.face"))] + [
    ("sfsync.optim", "SyncOptimizer", "sfsync.torch.optim"),
    ("sfsync.optim", "Phase", "sfsync.torch.optim"),
] + [("sfsync", n, "sfsync.errors") for n in (
    "SfError", "InvalidArgumentError", "InvalidStateError", "MismatchError", "BackendError",
    "SfTimeoutError", "UnsupportedError", "SfMemoryError", "InternalError", "LibraryLoadError",
    "STATUS_NAMES")] + [("sfsync", n, "sfsync.loader") for n in (
    "lib", "load", "library_path", "check_abi", "version", "version_number", "abi_version",
    "status_string", "last_error", "backend_available", "backend_unavailable_reason", "log",
    "log_level", "SINCE_0_2", "SINCE_0_3", "SINCE_0_4")] + [
    ("sfsync", n, "sfsync.context") for n in ("Context", "options", "digest", "DTYPE_SIZES",
                                              "DTYPE_NAMES")] + [
    ("sfsync", n, "sfsync._abi") for n in ("ABI_VERSION", "Options", "Stats", "Store",
                                           "LOG_NONE", "LOG_WARN", "LOG_INFO", "LOG_TRACE")]

#: The framework integrations: sfsync.integrations.X (0.3) is
#: sfsync.torch.integrations.X, name for name (the framework imported only
#: where it is installed).
INTEGRATIONS = {"_module": None, "accelerate": "accelerate", "lightning": "lightning",
                "transformers": "transformers"}

#: Modules whose public names stay where they were (their __all__, or the
#: names listed for a module without one).
STAYED = {"sfsync.shard": None, "sfsync.host_window": None, "sfsync.launch": None,
          "sfsync.doctor": ["needed_libraries", "symbol_definer", "torch_gloo", "report",
                            "main"]}


class Locations(unittest.TestCase):
    def test_every_moved_name_is_the_same_object_at_both_locations(self):
        import importlib
        try:
            import torch  # noqa: F401
        except ImportError:
            self.skipTest("no torch")
        for old, name, new in MOVED:
            a = getattr(importlib.import_module(old), name)
            b = getattr(importlib.import_module(new), name)
            self.assertIs(a, b, "%s.%s is not %s.%s" % (old, name, new, name))
        import sfsync
        import sfsync.torch
        for name in sfsync.__all__:
            self.assertTrue(hasattr(sfsync, name), "sfsync.%s" % name)
        for name in sfsync.torch.__all__:
            self.assertTrue(hasattr(sfsync.torch, name), "sfsync.torch.%s" % name)
        # the 0.3 private names the package's tests read
        for name in ("_ContextPtr", "_STATUS", "_candidates", "_Missing", "_ERROR_CLASSES"):
            self.assertTrue(hasattr(sfsync, name), "sfsync.%s" % name)
        self.assertTrue(callable(sfsync.torch._torch_store_callbacks))

    def test_modules_that_stayed_import_with_their_names(self):
        import importlib
        for mod, names in STAYED.items():
            m = importlib.import_module(mod)
            names = names or m.__all__
            self.assertTrue(names, mod)
            for name in names:
                self.assertTrue(hasattr(m, name), "%s.%s" % (mod, name))

    def test_integrations_are_the_same_objects_at_both_locations(self):
        import importlib
        import sfsync.integrations
        if importlib.util.find_spec("torch") is None:
            self.skipTest("no torch")
        import sfsync.torch.integrations
        self.assertIs(sfsync.integrations.SyncedModule, sfsync.torch.integrations.SyncedModule)
        checked = 0
        for mod, framework in INTEGRATIONS.items():
            if framework is not None and importlib.util.find_spec(framework) is None:
                continue  # the framework is not installed under this interpreter
            old = importlib.import_module("sfsync.integrations." + mod)
            new = importlib.import_module("sfsync.torch.integrations." + mod)
            self.assertEqual(old.__all__, new.__all__, mod)
            for name in new.__all__:
                self.assertIs(getattr(old, name), getattr(new, name), "%s.%s" % (mod, name))
                checked += 1
        self.assertGreater(checked, 0)


class PackageMapTests(unittest.TestCase):
    """python/README.md's Layout names every module of the package: one
    added without a line there fails here (issue 44, item 5)."""

    def test_every_module_is_in_the_layout(self):
        with open(os.path.join(PACKAGE, "..", "README.md")) as f:
            text = f.read()
        start = text.index("## Layout")
        block = text[text.index("```", start) + 3:]
        block = block[:block.index("```")]
        words = set(block.replace("(", " ").replace(")", " ").replace(",", " ").split())
        words |= {w.rsplit("/", 1)[-1] for w in words}  # "sfsync/loader.py" names "loader.py"
        missing = [rel for rel, _ in sorted(_modules(PACKAGE))
                   if os.path.basename(rel) not in words]  # each module by its file name
        self.assertEqual(missing, [], "modules python/README.md's Layout does not name")


if __name__ == "__main__":
    unittest.main()
