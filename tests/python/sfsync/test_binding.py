"""Tests of the package's ctypes binding (python/sfsync) against the C ABI: every
function's prototype and every struct layout checked against include/sfsync.h.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 /usr/bin/python3 tests/python/sfsync/test_binding.py -v

Needs only the standard library and numpy. The layout test compares the
ctypes structs with the C compiler's view of include/sfsync.h: it runs the
probe named by SFSYNC_LAYOUT_PROBE (built by CMake), else compiles one with
cc, else is skipped.
"""

import ctypes
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest
import uuid

# This folder holds torch/ (the tests of sfsync.torch): off sys.path, or where no
# torch is installed `import torch` would find that folder (a namespace package).
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".")
               != os.path.realpath(os.path.dirname(os.path.abspath(__file__)))]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))  # the package from the source tree

import numpy as np  # noqa: E402

import sfsync  # noqa: E402

HEADER = os.path.join(ROOT, "include", "sfsync.h")
MiB = 1048576


def header_text():
    with open(HEADER) as f:
        return f.read()


def local_context(**overrides):
    """A one-rank context, independent of the launcher's environment."""
    base = dict(rank=0, world_size=1, rendezvous="")
    base.update(overrides)
    return sfsync.Context(**base)


# ---- The header, read by the tests (comments stripped where it matters) ------

C_SCALARS = {"int32_t": ctypes.c_int32, "sf_status": ctypes.c_int32, "sf_dtype": ctypes.c_int32,
             "sf_device": ctypes.c_int32, "sf_backend": ctypes.c_int32,
             "sf_reduce_op": ctypes.c_int32, "sf_shard_layout": ctypes.c_int32,
             "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "double": ctypes.c_double,
             "void": None}


def c_pointers():
    c = ctypes
    return {"void*": c.c_void_p, "const void*": c.c_void_p, "const char*": c.c_char_p,
            "const char* const*": c.POINTER(c.c_char_p),
            "sf_context*": sfsync._ContextPtr, "const sf_context*": sfsync._ContextPtr,
            "sf_context**": c.POINTER(sfsync._ContextPtr),
            "sf_options*": c.POINTER(sfsync.Options),
            "const sf_options*": c.POINTER(sfsync.Options),
            "sf_stats*": c.POINTER(sfsync.Stats), "sf_store*": c.POINTER(sfsync.Store),
            "const sf_store*": c.POINTER(sfsync.Store),
            "sf_launch_info*": c.POINTER(sfsync.LaunchInfo),
            "int64_t*": c.POINTER(c.c_int64), "uint64_t*": c.POINTER(c.c_uint64),
            "double*": c.POINTER(c.c_double), "const double*": c.POINTER(c.c_double),
            "void**": c.POINTER(c.c_void_p), "sf_dtype*": c.POINTER(c.c_int32),
            "int32_t*": c.POINTER(c.c_int32)}


def c_type(decl):
    """The ctypes type of a C type as the header spells it."""
    decl = re.sub(r"\s*\*", "*", re.sub(r"\s+", " ", decl)).strip()
    decl = re.sub(r"\*(?=\w)", "* ", decl)  # "char* const*" keeps its space
    if "*" in decl:
        return c_pointers()[decl]
    return C_SCALARS[decl]


def uncommented(text):
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def header_prototypes():
    """[(return type, name, [parameter types])] of every SF_API function."""
    out = []
    for ret, name, params in re.findall(r"SF_API\s+([\w\s\*]+?)\b(sf_\w+)\s*\(([^)]*)\)\s*;",
                                        uncommented(header_text())):
        params = [p.strip() for p in params.split(",")]
        if params == ["void"]:
            params = []
        types = []
        for p in params:
            m = re.match(r"^(.*[\s\*])(\w+)$", p)  # drop the parameter's name
            types.append(m.group(1))
        out.append((ret, name, types))
    return out


def header_since():
    """name -> the sfsync version that added it, as the header documents it:
    a doc block that ends "Since X.Y." right above the declaration, else its
    section's "(Since X.Y)", else 0.1. Functions and typedef structs alike."""
    out = {}
    section = "0.1"
    decl = r"(?:SF_API\s+[\w\s\*]+?\b(sf_\w+)\s*\(|typedef struct (sf_\w+) \{)"
    pattern = r"/\* ---- (.*?)-{3,}|(/\*\*?(?:(?!\*/).)*\*/)\s*" + decl + "|" + decl
    for m in re.finditer(pattern, header_text(), re.S):
        if m.group(1) is not None:
            s = re.search(r"\(Since (\d+\.\d+)\)", m.group(1))
            section = s.group(1) if s else "0.1"
            continue
        name = m.group(3) or m.group(4) or m.group(5) or m.group(6)
        doc = re.search(r"Since (\d+\.\d+)\.\s*\*/$", (m.group(2) or "").strip())
        out[name] = doc.group(1) if doc else section
    return out


def header_structs():
    """C name -> [(field, C declaration)] of every struct with a body."""
    defines = dict(re.findall(r"#define (SF_\w+) (\d+)\b", header_text()))
    out = {}
    for name, body, alias in re.findall(r"typedef struct (sf_\w+) \{(.*?)\} (sf_\w+);",
                                        uncommented(header_text()), re.S):
        assert name == alias, name
        fields = []
        for decl in (d.strip() for d in body.split(";")):
            if not decl:
                continue
            fp = re.match(r"^([\w\s\*]+?)\s*\(\s*\*\s*(\w+)\s*\)\s*\((.*)\)$", decl, re.S)
            arr = re.match(r"^([\w\s\*]+?)\s*\b(\w+)\s*\[(\w+)\]$", decl)
            if fp:  # a function pointer: ("fn", return type, parameter types)
                params = [re.match(r"^(.*[\s\*])(\w+)$", p.strip()).group(1)
                          for p in fp.group(3).split(",")]
                fields.append((fp.group(2), ("fn", fp.group(1), params)))
            elif arr:
                n = arr.group(3)
                fields.append((arr.group(2), ("array", arr.group(1).strip(),
                                              int(defines.get(n, n)))))
            else:
                m = re.match(r"^(.*[\s\*])(\w+)$", decl)
                fields.append((m.group(2), ("scalar", m.group(1))))
        out[name] = fields
    return out


def c_field_type(spec):
    kind = spec[0]
    if kind == "scalar":
        return c_type(spec[1])
    if kind == "array":
        assert spec[1] == "char", spec
        return ctypes.c_char * spec[2]
    return None  # function pointers: checked on their own


class HeaderCoverage(unittest.TestCase):
    def test_every_header_function_is_bound(self):
        declared = set(re.findall(r"SF_API\s+[\w\s\*]+?\b(sf_\w+)\s*\(", header_text()))
        self.assertGreaterEqual(len(declared), 24)
        self.assertEqual(declared, set(sfsync.FUNCTIONS))
        self.assertEqual(set(sfsync._abi.PROTOTYPES), set(sfsync.FUNCTIONS))

    def test_prototypes_match_header(self):
        """Every bound function's restype, argument count and argtypes are
        the C types the header declares, parameter by parameter (a ctypes
        mirror cannot be checked by the compiler: this is that check), and
        the loaded library's functions carry exactly those."""
        c = ctypes
        protos = header_prototypes()
        self.assertEqual(len(protos), len(sfsync.FUNCTIONS))
        dll = sfsync.lib()
        for ret, name, params in protos:
            proto = sfsync._abi.PROTOTYPES[name]
            restype = c.c_int32 if proto.restype is sfsync._STATUS else proto.restype
            argtypes = [c.c_int32 if t is sfsync._STATUS else t for t in proto.argtypes]
            self.assertEqual(c_type(ret), restype, "%s returns %s" % (name, ret.strip()))
            self.assertEqual(len(argtypes), len(params),
                             "%s: %d arguments bound, the header declares %d"
                             % (name, len(argtypes), len(params)))
            self.assertEqual([c_type(p) for p in params], argtypes,
                             "%s(%s)" % (name, ", ".join(params)))
            self.assertEqual(proto.restype is sfsync._STATUS, ret.strip() == "sf_status", name)
            fn = getattr(dll, name)
            if not isinstance(fn, sfsync._Missing):
                self.assertEqual(list(fn.argtypes), argtypes, name)

    def test_since_versions_match_header(self):
        """Each function's and struct's Since in the binding is the one the
        header documents; a function newer than 0.1 that an older library
        lacks is bound as _Missing, never a load failure."""
        since = header_since()
        for name, proto in sfsync._abi.PROTOTYPES.items():
            self.assertEqual(proto.since, since[name], "Since of %s" % name)
        for name, (_, version) in sfsync._abi.STRUCTS.items():
            self.assertEqual(version, since[name], "Since of %s" % name)
        for version in ("0.2", "0.3", "0.4"):
            self.assertEqual(set(getattr(sfsync, "SINCE_" + version.replace(".", "_"))),
                             {n for n, v in since.items() if v == version and n in
                              sfsync._abi.PROTOTYPES})

    def test_every_header_struct_is_bound_field_by_field(self):
        """Every struct of the header has one binding (sfsync._abi.STRUCTS)
        with the header's fields, in order, of the header's types."""
        structs = header_structs()
        self.assertGreaterEqual(len(structs), 4)
        self.assertEqual(set(structs), set(sfsync._abi.STRUCTS))
        for c_name, fields in structs.items():
            py = sfsync._abi.STRUCTS[c_name][0]
            self.assertEqual([n for n, _ in py._fields_], [n for n, _ in fields],
                             "fields of %s" % c_name)
            for (name, spec), (_, py_type) in zip(fields, py._fields_):
                if spec[0] == "fn":
                    self.assertEqual(py_type._restype_, c_type(spec[1]), "%s.%s" % (c_name, name))
                    self.assertEqual(list(py_type._argtypes_), [c_type(p) for p in spec[2]],
                                     "%s.%s" % (c_name, name))
                else:
                    want = c_field_type(spec)
                    if spec[0] == "array":  # a ctypes array type is made anew each time
                        self.assertEqual((py_type._type_, py_type._length_),
                                         (want._type_, want._length_), "%s.%s" % (c_name, name))
                    else:
                        self.assertEqual(py_type, want, "%s.%s" % (c_name, name))

    def test_bound_functions_are_exported(self):
        # The checked-in export list may hold more (the shim's internal
        # interface, not in the public header); every public one must be there.
        path = os.path.join(ROOT, "tests", "exported_symbols.txt")
        if not os.path.exists(path):
            self.skipTest("no tests/exported_symbols.txt")
        with open(path) as f:
            exported = {line.strip() for line in f if line.strip()}
        self.assertEqual(set(sfsync.FUNCTIONS) - exported, set())
        for name in sfsync.FUNCTIONS:  # and the loaded library has them
            self.assertTrue(hasattr(sfsync.lib(), name), name)

    def test_no_module_binds_functions_of_its_own(self):
        """One binding: no module of the package but loader.py (whose _bind
        applies _abi's table; __init__.py's until 0.3) types an sf_* function, keeps an argtypes
        table, makes a CFUNCTYPE over a symbol's address, or mirrors a struct
        of its own (shard.py's _Stats03 was one)."""
        pkg = os.path.dirname(os.path.abspath(sfsync.__file__))
        for root, _, files in os.walk(pkg):
            for f in files:
                if not f.endswith(".py") or f == "_abi.py":
                    continue
                path = os.path.join(root, f)
                rel = os.path.relpath(path, pkg)
                with open(path) as fh:
                    text = fh.read()
                for line in text.splitlines():
                    if rel != "loader.py" and "sf_" in line:
                        self.assertNotRegex(line, r"\.(argtypes|restype)\s*=", rel)
                    self.assertNotRegex(line, r"CFUNCTYPE\(.*\)\(\s*_?c(types)?\.cast", rel)
                    self.assertNotRegex(line, r"^_?ARGTYPES\s*=|^_ARGTYPES\s*=", rel)
                    self.assertNotRegex(line, r"^class _?Stats\w*\(", rel)

    def test_constants_match_header(self):
        defines = dict(re.findall(r"#define (SF_\w+) (-?\d+)\b", header_text()))
        checked = 0
        for name, value in defines.items():
            if name.startswith("SF_VERSION_"):
                continue
            py = name[3:]  # SF_ERR_MISMATCH -> ERR_MISMATCH, SF_OK -> OK
            self.assertTrue(hasattr(sfsync, py), "sfsync.py lacks %s" % py)
            self.assertEqual(getattr(sfsync, py), int(value), name)
            checked += 1
        self.assertGreaterEqual(checked, 23)
        self.assertEqual(sfsync.ABI_VERSION, int(defines["SF_ABI_VERSION"]))

    def test_every_status_has_an_exception_class(self):
        for status, name in sfsync.STATUS_NAMES.items():
            if status == sfsync.OK:
                continue
            cls = sfsync._ERROR_CLASSES[status]
            self.assertTrue(issubclass(cls, sfsync.SfError), name)
            self.assertNotIn(sfsync.status_string(status), ("", "unknown status"), name)
        self.assertEqual(sfsync.status_string(12345), "unknown status")


class StructLayout(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        probe = os.environ.get("SFSYNC_LAYOUT_PROBE")
        cls.tmp = None
        if not probe:
            cc = shutil.which("cc") or shutil.which("gcc")
            if not cc:
                raise unittest.SkipTest("no SFSYNC_LAYOUT_PROBE and no C compiler")
            cls.tmp = tempfile.mkdtemp()
            probe = os.path.join(cls.tmp, "probe")
            subprocess.run([cc, "-std=c99", "-I", os.path.join(ROOT, "include"),
                            os.path.join(HERE, "..", "support", "layout_probe.c"), "-o", probe],
                           check=True)
        out = subprocess.run([probe], check=True, capture_output=True, text=True).stdout
        cls.layout = json.loads(out)

    @classmethod
    def tearDownClass(cls):
        if cls.tmp:
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def check(self, c_name, struct):
        c = self.layout[c_name]
        self.assertEqual(ctypes.sizeof(struct), c["size"], "sizeof(%s)" % c_name)
        py_fields = [name for name, _ in struct._fields_]
        self.assertEqual(py_fields, list(c["fields"]), "field order of %s" % c_name)
        # The probe lists what the header declares, no field left out.
        self.assertEqual(list(c["fields"]), [n for n, _ in header_structs()[c_name]],
                         "layout_probe.c's fields of %s" % c_name)
        for name, (offset, size) in c["fields"].items():
            desc = getattr(struct, name)
            self.assertEqual((desc.offset, desc.size), (offset, size), "%s.%s" % (c_name, name))

    def test_every_struct_is_probed(self):
        self.assertEqual(set(self.layout) - {"SF_ABI_VERSION", "SF_VERSION_NUMBER"},
                         set(sfsync._abi.STRUCTS))

    def test_options_layout(self):
        self.check("sf_options", sfsync.Options)

    def test_store_layout(self):
        self.check("sf_store", sfsync.Store)

    def test_stats_layout(self):
        self.check("sf_stats", sfsync.Stats)

    def test_launch_info_layout(self):
        self.check("sf_launch_info", sfsync.LaunchInfo)

    def test_every_struct_layout(self):
        for c_name, (struct, _) in sfsync._abi.STRUCTS.items():
            self.check(c_name, struct)

    def test_versions(self):
        self.assertEqual(sfsync.abi_version(), self.layout["SF_ABI_VERSION"])
        self.assertEqual(sfsync.version_number(), self.layout["SF_VERSION_NUMBER"])
        major, minor, patch = map(int, sfsync.version().split("."))
        self.assertEqual(major * 10000 + minor * 100 + patch, sfsync.version_number())


class Loading(unittest.TestCase):
    def test_abi_mismatch_is_refused(self):
        class Fake:
            def sf_abi_version(self):
                return sfsync.ABI_VERSION + 1
        with self.assertRaisesRegex(sfsync.LibraryLoadError, r"ABI version 2.*written for ABI "
                                    r"version 1"):
            sfsync.check_abi(Fake(), "libfake.so")
        sfsync.check_abi(sfsync.lib(), "the loaded library")  # no raise

    def test_loaded_from_sfsync_library_when_set(self):
        wanted = os.environ.get("SFSYNC_LIBRARY")
        if not wanted:
            self.skipTest("SFSYNC_LIBRARY not set")
        self.assertEqual(os.path.realpath(sfsync.library_path()), os.path.realpath(wanted))

    def test_no_build_tree_is_searched(self):
        """The binding found the library by globbing build*/ of the checkout:
        the package only knows SFSYNC_LIBRARY, its install record, a bundled
        copy, and the system loader."""
        pkg = os.path.dirname(os.path.abspath(sfsync.__file__))
        has_record = os.path.exists(os.path.join(pkg, "_install.py"))
        for c in sfsync._candidates():
            self.assertNotIn("build", c.replace(pkg, ""), c)
        if not has_record and not os.path.exists(os.path.join(pkg, "libsfsync.so.1")):
            self.assertEqual(sfsync._candidates(), ["libsfsync.so.1"])
        env = {k: v for k, v in os.environ.items() if k not in ("SFSYNC_LIBRARY",
                                                                "LD_LIBRARY_PATH")}
        env["PYTHONPATH"] = os.path.dirname(pkg)
        r = subprocess.run([sys.executable, "-c", "import sfsync; print(sfsync.library_path())"],
                           cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)
        if r.returncode == 0:  # an installed libsfsync.so.1 on the loader path
            self.assertNotIn(ROOT, r.stdout)
        else:
            self.assertIn("LibraryLoadError", r.stderr)
            self.assertNotIn("/build", r.stderr)

    def test_installed_package_finds_its_own_library(self):
        """What cmake --install writes (_install.py: the library relative to
        the package) is enough: no environment variable, any directory."""
        wanted = os.environ.get("SFSYNC_LIBRARY")
        if not wanted:
            self.skipTest("SFSYNC_LIBRARY not set (the library to install)")
        tmp = tempfile.mkdtemp()
        try:
            site = os.path.join(tmp, "lib", "python3", "dist-packages")
            shutil.copytree(os.path.dirname(os.path.abspath(sfsync.__file__)),
                            os.path.join(site, "sfsync"),
                            ignore=shutil.ignore_patterns("__pycache__", "_install.py"))
            shutil.copy(wanted, os.path.join(tmp, "lib", "libsfsync.so.1"))
            with open(os.path.join(site, "sfsync", "_install.py"), "w") as f:
                f.write('LIBRARY = "../../../libsfsync.so.1"\n')
            env = {k: v for k, v in os.environ.items() if k not in ("SFSYNC_LIBRARY",
                                                                    "LD_LIBRARY_PATH")}
            env["PYTHONPATH"] = site
            r = subprocess.run([sys.executable, "-m", "sfsync"], cwd="/", env=env,
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("library: %s\n" % os.path.join(tmp, "lib", "libsfsync.so.1"), r.stdout)
            self.assertIn("version: %s\n" % sfsync.version(), r.stdout)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_missing_0_2_function_raises_unsupported(self):
        missing = sfsync._Missing("sf_connect", "libold.so")
        with self.assertRaisesRegex(sfsync.UnsupportedError, r"sf_connect: libold\.so does not "
                                    r"export it \(it is older than sfsync 0\.2\)"):
            missing(None)

    def test_loading_another_path_is_refused(self):
        with self.assertRaisesRegex(sfsync.LibraryLoadError, "already loaded"):
            sfsync.load("/nonexistent/libsfsync.so.1")


class ErrorMapping(unittest.TestCase):
    """Every failure raises the status's class, with the plugin's message
    naming the function and the argument at fault."""

    def assert_sf_error(self, cls, pattern, fn, *args, **kwargs):
        with self.assertRaises(cls) as cm:
            fn(*args, **kwargs)
        e = cm.exception
        self.assertIsInstance(e, sfsync.SfError)
        self.assertRegex(e.message, pattern)
        self.assertEqual(e.status, {sfsync.InvalidArgumentError: 1, sfsync.InvalidStateError: 2,
                                    sfsync.MismatchError: 3}[cls])
        self.assertEqual(e.status_string, sfsync.status_string(e.status))
        self.assertIn(e.status_name, str(e))
        self.assertIn(e.message, str(e))
        return e

    def test_null_arguments_name_the_argument(self):
        L = sfsync.lib()
        e = self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_create: out is NULL",
                                 L.sf_create, None, None)
        self.assertEqual(e.function, "sf_create")
        self.assertIsInstance(e, ValueError)
        self.assertEqual(sfsync.last_error(), e.message)  # the thread's sf_last_error()
        self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_options_init: opts is NULL",
                             L.sf_options_init, None, ctypes.sizeof(sfsync.Options))
        self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_default_context: out is NULL",
                             L.sf_default_context, None)
        stats = sfsync.Stats()
        stats.struct_size = ctypes.sizeof(stats)
        self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_get_stats: ctx is NULL",
                             L.sf_get_stats, None, ctypes.byref(stats))
        for name in ("sf_synchronize", "sf_begin_accumulation", "sf_end_accumulation",
                     "sf_build_buckets", "sf_zero_gradients"):
            self.assert_sf_error(sfsync.InvalidArgumentError, r"^%s: ctx is NULL" % name,
                                 getattr(L, name), None)
        self.assertEqual(L.sf_in_accumulation(None), -1)
        L.sf_destroy(None)  # accepted and ignored

    def test_context_out_pointers_name_the_argument(self):
        L = sfsync.lib()
        with local_context() as ctx:
            self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_add_gradient: out_id is NULL",
                                 L.sf_add_gradient, ctx.handle, 4, 0, 0, None, None)
        with local_context() as ctx:
            self.assert_sf_error(sfsync.InvalidArgumentError,
                                 r"^sf_register_gradient: out_id is NULL", L.sf_register_gradient,
                                 ctx.handle, ctypes.addressof(ctypes.c_float()), 1, 0, 0, None,
                                 None)
        with local_context() as ctx:
            gid = ctx.add_gradient(4)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_gradient_data: out is NULL",
                                 L.sf_gradient_data, ctx.handle, gid, None)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_get_options: out is NULL",
                                 L.sf_get_options, ctx.handle, None)

    def test_failed_add_gradient_registers_nothing(self):
        """A call that fails changes nothing: sf_add_gradient with out_id ==
        NULL registers no gradient (the plugin checks out-pointers before
        any side effect)."""
        L = sfsync.lib()
        with local_context() as ctx:
            with self.assertRaises(sfsync.InvalidArgumentError):
                L.sf_add_gradient(ctx.handle, 4, 0, 0, None, None)
            self.assertEqual(ctx.stats()["gradient_count"], 0)

    def test_struct_size_too_small(self):
        L = sfsync.lib()
        opts = sfsync.Options()
        self.assert_sf_error(sfsync.InvalidArgumentError, r"struct_size = 8 is smaller than "
                             r"sizeof\(sf_options\) = 320", L.sf_options_init,
                             ctypes.byref(opts), 8)
        with local_context() as ctx:
            stats = sfsync.Stats()
            stats.struct_size = 16
            self.assert_sf_error(sfsync.InvalidArgumentError, r"out->struct_size = 16",
                                 L.sf_get_stats, ctx.handle, ctypes.byref(stats))
            self.assertEqual(stats.windows_begun, 0)  # out-parameter untouched

    def test_bad_caps_name_the_value(self):
        with local_context() as ctx:
            for bad, shown in ((0.0, "0"), (-1.5, "-1.5"), (math.nan, "nan"), (math.inf, "inf")):
                self.assert_sf_error(sfsync.InvalidArgumentError,
                                     r"^sf_set_bucket_cap_mb: bucket_cap_mb = %s is invalid"
                                     % shown, ctx.set_bucket_cap_mb, bad)
                self.assert_sf_error(sfsync.InvalidArgumentError,
                                     r"^sf_set_first_bucket_cap_mb: first_bucket_cap_mb = %s is "
                                     r"invalid" % shown, ctx.set_first_bucket_cap_mb, bad)
            self.assertEqual(ctx.options()["bucket_cap_mb"], 25.0)  # unchanged
            ctx.set_bucket_cap_mb(0.5)
            self.assertEqual(ctx.options()["bucket_cap_mb"], 0.5)
        self.assert_sf_error(sfsync.InvalidArgumentError, r"opts->bucket_cap_mb = -2",
                             sfsync.Context, bucket_cap_mb=-2.0, rank=0, world_size=1,
                             rendezvous="")

    def test_bad_gradients_name_the_argument(self):
        with local_context() as ctx:
            self.assert_sf_error(sfsync.InvalidArgumentError, r"numel = 0 must be positive",
                                 ctx.add_gradient, 0)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"numel = -3", ctx.add_gradient, -3)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"dtype = 9 is not an sf_dtype",
                                 ctx.add_gradient, 4, 9)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"device = 5 is not an sf_device",
                                 ctx.add_gradient, 4, sfsync.DTYPE_FLOAT32, 5)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_register_gradient: data is "
                                 r"NULL", ctx.register_gradient, None, 4, sfsync.DTYPE_FLOAT32)
            self.assertEqual(ctx.gradient_count, 0)  # nothing half-registered
            gid = ctx.add_gradient(4)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"^sf_grad_ready: id = 7 is not a "
                                 r"registered gradient \(ids are 0..0\)", ctx.grad_ready, 7)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"id = -1", ctx.gradient_data, -1)
            self.assert_sf_error(sfsync.InvalidStateError, r"buckets are not built",
                                 ctx.bucket_info, 0)
            ctx.build_buckets()
            self.assertEqual(gid, 0)
            self.assert_sf_error(sfsync.InvalidArgumentError, r"index = 3 is not a bucket",
                                 ctx.bucket_info, 3)

    def test_bad_options(self):
        self.assert_sf_error(sfsync.InvalidArgumentError, r"opts->rank = 2 is outside",
                             sfsync.Context, rank=2, world_size=2, rendezvous="memory://x")
        self.assert_sf_error(sfsync.InvalidArgumentError, r"rendezvous is empty but world_size = 2",
                             sfsync.Context, rank=0, world_size=2, rendezvous="")
        self.assert_sf_error(sfsync.InvalidArgumentError, r"reserved0 = 1 must be 0",
                             sfsync.Context, reserved0=1, rank=0, world_size=1, rendezvous="")
        with self.assertRaises(TypeError):
            sfsync.options(no_such_field=1)
        with self.assertRaisesRegex(sfsync.InvalidArgumentError, "rendezvous is 300 bytes"):
            sfsync.options(rendezvous="x" * 300)

    def test_environment_variable_that_does_not_parse(self):
        old = os.environ.get("SF_BUCKET_CAP_MB")
        os.environ["SF_BUCKET_CAP_MB"] = "lots"
        try:
            self.assert_sf_error(sfsync.InvalidArgumentError,
                                 r"^sf_options_init: environment variable SF_BUCKET_CAP_MB='lots'",
                                 sfsync.options)
        finally:
            if old is None:
                del os.environ["SF_BUCKET_CAP_MB"]
            else:
                os.environ["SF_BUCKET_CAP_MB"] = old
        os.environ["SF_FIRST_BUCKET_CAP_MB"] = "0.25"
        try:
            self.assertEqual(sfsync.options().first_bucket_cap_mb, 0.25)
        finally:
            del os.environ["SF_FIRST_BUCKET_CAP_MB"]

    def test_options_defaults_and_names(self):
        o = sfsync.options(rank=0, world_size=1, rendezvous="", backend="gloo", reduce_op="sum")
        self.assertEqual(o.struct_size, ctypes.sizeof(sfsync.Options))
        d = o.to_dict()
        self.assertEqual(d["backend"], sfsync.BACKEND_GLOO)
        self.assertEqual(d["reduce_op"], sfsync.REDUCE_SUM)
        with sfsync.Context(o) as ctx:
            got = ctx.options()
            self.assertEqual(got["backend"], sfsync.BACKEND_GLOO)
            self.assertEqual(got["reduce_op"], sfsync.REDUCE_SUM)
            self.assertEqual(got["first_bucket_cap_mb"], 1.0)
            self.assertEqual(got["timeout_ms"], 300000)
            self.assertEqual(got["rendezvous"], "")


class Backends(unittest.TestCase):
    def test_backend_available(self):
        self.assertTrue(sfsync.backend_available(sfsync.BACKEND_GLOO))
        self.assertTrue(sfsync.backend_available("auto"))
        self.assertIsNone(sfsync.backend_unavailable_reason("gloo"))
        reason = sfsync.backend_unavailable_reason("nccl")  # no GPU here: a reason
        self.assertTrue(reason is None or reason.startswith("sf_backend_available: "), reason)
        with self.assertRaisesRegex(sfsync.InvalidArgumentError,
                                    r"^sf_backend_available: backend = 9 is not an sf_backend"):
            sfsync.backend_available(9)

    def test_cuda_calls_on_a_host_context(self):
        with local_context() as ctx:
            ctx.set_cuda_stream(None)  # the legacy default stream: accepted, loads nothing
            with self.assertRaisesRegex(sfsync.InvalidArgumentError,
                                        r"^sf_adopt_nccl_comm: comm is NULL"):
                ctx.adopt_nccl_comm(None)
        with self.assertRaisesRegex(sfsync.InvalidArgumentError, r"^sf_set_cuda_stream: ctx is "
                                    r"NULL"):
            sfsync.lib().sf_set_cuda_stream(None, None)


class WindowMisuse(unittest.TestCase):
    def setUp(self):
        self.ctx = local_context()
        self.a = self.ctx.add_gradient(8, name="layer.weight")
        self.b = self.ctx.add_gradient(2, name="layer.bias")

    def tearDown(self):
        self.ctx.close()

    def test_synchronize_inside_window(self):
        self.ctx.begin_accumulation()
        self.assertTrue(self.ctx.in_accumulation())
        with self.assertRaisesRegex(sfsync.InvalidStateError,
                                    r"^sf_synchronize: .*inside an accumulation window") as cm:
            self.ctx.synchronize()
        self.assertEqual(cm.exception.status, sfsync.ERR_INVALID_STATE)
        self.assertEqual(self.ctx.stats()["windows_completed"], 0)
        self.ctx.end_accumulation()
        self.assertFalse(self.ctx.in_accumulation())
        self.ctx.synchronize()
        self.assertEqual(self.ctx.stats()["windows_completed"], 1)

    def test_begin_twice_and_end_without_begin(self):
        with self.assertRaisesRegex(sfsync.InvalidStateError, r"^sf_end_accumulation: not inside"):
            self.ctx.end_accumulation()
        self.ctx.begin_accumulation()
        with self.assertRaisesRegex(sfsync.InvalidStateError,
                                    r"^sf_begin_accumulation: already inside"):
            self.ctx.begin_accumulation()
        self.assertEqual(self.ctx.stats()["windows_begun"], 1)

    def test_accumulate_leaves_the_window_on_error(self):
        with self.assertRaises(KeyError):
            with self.ctx.accumulate():
                self.assertTrue(self.ctx.in_accumulation())
                raise KeyError("body failed")
        self.assertFalse(self.ctx.in_accumulation())
        with self.ctx.accumulate():
            pass
        self.assertEqual(self.ctx.stats()["windows_begun"], 2)

    def test_grad_ready_twice_outside_a_window(self):
        self.ctx.grad_ready(self.a)
        with self.assertRaisesRegex(sfsync.InvalidStateError, r"gradient 0 \('layer.weight'\) "
                                    r"was already reported ready"):
            self.ctx.grad_ready(self.a)
        self.ctx.synchronize()
        self.ctx.grad_ready(self.a)  # a new pass after synchronize: fine

    def test_late_registration_and_caps(self):
        self.ctx.build_buckets()
        with self.assertRaisesRegex(sfsync.InvalidStateError, r"^sf_add_gradient: the buckets "
                                    r"are already built"):
            self.ctx.add_gradient(4)
        with self.assertRaisesRegex(sfsync.InvalidStateError, r"^sf_set_bucket_cap_mb: "):
            self.ctx.set_bucket_cap_mb(1.0)
        with self.assertRaisesRegex(sfsync.InvalidStateError, r"^sf_register_gradient: "):
            self.ctx.register_gradient(np.zeros(4, np.float32))

    def test_build_without_gradients(self):
        with local_context() as empty:
            with self.assertRaisesRegex(sfsync.InvalidStateError, "no gradient is registered"):
                empty.build_buckets()
            with self.assertRaisesRegex(sfsync.InvalidStateError, "no gradient is registered"):
                empty.synchronize()

    def test_restore_windows(self):
        """Context.restore_windows (sf_restore_windows, Since 0.4): the count
        goes on from the restored one; a negative count and a call after the
        first synchronization raise, naming the value / saying when to call."""
        with self.assertRaisesRegex(sfsync.InvalidArgumentError,
                                    r"^sf_restore_windows: windows_completed = -2 is negative"):
            self.ctx.restore_windows(-2)
        self.ctx.restore_windows(40)
        self.assertEqual(self.ctx.stats()["windows_completed"], 40)
        with self.ctx.accumulate():
            pass
        self.ctx.synchronize()
        s = self.ctx.stats()
        self.assertEqual((s["windows_completed"], s["windows_begun"]), (41, 1))
        with self.assertRaisesRegex(sfsync.InvalidStateError, r"^sf_restore_windows: too late .*"
                                    r"right after sf_create, before training resumes") as cm:
            self.ctx.restore_windows(3)
        self.assertEqual(cm.exception.status, sfsync.ERR_INVALID_STATE)
        self.assertEqual(self.ctx.stats()["windows_completed"], 41)

    def test_closed_context(self):
        self.ctx.close()
        self.ctx.close()  # idempotent
        with self.assertRaisesRegex(sfsync.InvalidStateError, "closed"):
            self.ctx.synchronize()


class StatsAndBuffers(unittest.TestCase):
    def test_stats_dict(self):
        with local_context() as ctx:
            ids = [ctx.add_gradient(n) for n in (1000, 1000, 1000)]
            s = ctx.stats()
            self.assertEqual(set(s), set(sfsync.STATS_KEYS))
            self.assertEqual(set(s), {"windows_begun", "windows_completed", "deferred_passes",
                                      "deferred_ready_calls", "collectives_issued",
                                      "early_launches", "bytes_reduced", "bucket_count",
                                      "largest_bucket_bytes", "smallest_bucket_bytes",
                                      "gradient_count", "gradient_bytes", "sync_ns_total",
                                      "reduce_scatters", "all_gathers", "bytes_gathered",
                                      "wire_allreduces", "wire_reduce_scatters",
                                      "wire_all_gathers", "wire_broadcasts", "wire_controls",
                                      "wire_bytes", "wire_gradient_bytes",
                                      "wire_parameter_bytes", "wire_mask_bytes",
                                      "wire_check_bytes", "wire_weight_bytes",
                                      "wire_host_bytes"})
            self.assertTrue(all(isinstance(v, int) for v in s.values()))
            self.assertEqual(s["bucket_count"], 0)  # not built yet
            self.assertEqual((s["gradient_count"], s["gradient_bytes"]), (3, 12000))

            with ctx.accumulate():  # two full deferred passes
                for _ in range(2):
                    for gid in ids:
                        ctx.grad_ready(gid)
            for gid in reversed(ids):  # reverse order: buckets complete and start early
                ctx.grad_ready(gid)
            ctx.synchronize()
            s = ctx.stats()
            self.assertEqual(s["windows_begun"], 1)
            self.assertEqual(s["windows_completed"], 1)
            self.assertEqual(s["deferred_passes"], 2)
            self.assertEqual(s["deferred_ready_calls"], 6)
            self.assertEqual(s["bucket_count"], 1)  # 12000 B under the 1 MiB first cap
            self.assertEqual(s["collectives_issued"], 1)
            self.assertEqual(s["early_launches"], 1)
            self.assertEqual(s["bytes_reduced"], 12000)
            self.assertEqual(s["largest_bucket_bytes"], 12000)
            self.assertGreater(s["sync_ns_total"], 0)
            # World size 1: the local reduction is a collective, but nothing travels.
            self.assertEqual({k: v for k, v in s.items() if k.startswith("wire_")},
                             {k: 0 for k in sfsync.STATS_KEYS if k.startswith("wire_")})

    def test_bucket_and_window_states_are_the_plugins(self):
        """Context.bucket_state / bucket_states / window_state (Since 0.5):
        the plugin's record of one window, asked through the binding."""
        with local_context(first_bucket_cap_mb=0.003, bucket_cap_mb=0.008) as ctx:
            for n in (1000, 1000, 1000):
                ctx.add_gradient(n)
            self.assertEqual(ctx.bucket_states(), [])
            self.assertEqual(ctx.window_state(), {"synchronizing": False,
                                                  "gradients_whole": False})
            refused = ErrorMapping.assert_sf_error
            refused(self, sfsync.InvalidStateError, r"^sf_bucket_state: the buckets are not built",
                    ctx.bucket_state, 0)
            ctx.build_buckets()
            self.assertEqual(ctx.bucket_states(), ["idle", "idle"])
            ctx.grad_ready(1)  # bucket 1 holds gradients 1 and 0
            self.assertEqual(ctx.bucket_states(), ["idle", "filling"])
            ctx.grad_ready(2)  # completes bucket 0: it starts
            self.assertEqual(ctx.bucket_states(), ["reducing", "filling"])
            self.assertTrue(ctx.window_state()["synchronizing"])
            ctx.synchronize()
            self.assertEqual(ctx.bucket_states(), ["reduced", "reduced"])
            self.assertEqual(ctx.window_state(), {"synchronizing": False,
                                                  "gradients_whole": True})
            refused(self, sfsync.InvalidArgumentError, r"^sf_bucket_state: index = 2 is not a "
                    r"bucket \(0..1\)", ctx.bucket_state, 2)

    def test_buckets_reverse_order_and_caps(self):
        # 3 x 4000 B, registered 0, 1, 2: gradient 2 (ready first in a
        # backward pass) opens the first bucket and alone brings it past its
        # cap (3146 B), which closes it; 1 and 0 share the next one (8000 B
        # under 8388 B).
        with local_context(first_bucket_cap_mb=0.003, bucket_cap_mb=0.008) as ctx:
            for n in (1000, 1000, 1000):
                ctx.add_gradient(n)
            self.assertEqual(ctx.buckets(), [
                {"bytes": 4000, "gradient_count": 1, "dtype": sfsync.DTYPE_FLOAT32},
                {"bytes": 8000, "gradient_count": 2, "dtype": sfsync.DTYPE_FLOAT32},
            ])
            # Gradient 2 alone completes bucket 0: it starts at once (early).
            ctx.grad_ready(2)
            self.assertEqual(ctx.stats()["early_launches"], 1)
            ctx.grad_ready(1)
            self.assertEqual(ctx.stats()["early_launches"], 1)
            ctx.synchronize()
            s = ctx.stats()
            self.assertEqual((s["collectives_issued"], s["early_launches"], s["bytes_reduced"]),
                             (2, 1, 12000))
            self.assertEqual((s["smallest_bucket_bytes"], s["largest_bucket_bytes"]),
                             (4000, 8000))

    def test_one_dtype_per_bucket(self):
        with local_context() as ctx:
            ctx.add_gradient(100)
            ctx.add_gradient(10, sfsync.DTYPE_FLOAT64)
            ctx.add_gradient(100)
            ctx.add_gradient(8, sfsync.DTYPE_BFLOAT16)
            got = sorted((b["dtype"], b["bytes"], b["gradient_count"]) for b in ctx.buckets())
            self.assertEqual(got, [(sfsync.DTYPE_FLOAT32, 800, 2), (sfsync.DTYPE_FLOAT64, 80, 1),
                                   (sfsync.DTYPE_BFLOAT16, 16, 1)])
            self.assertEqual(ctx.gradient_array(3).dtype, np.uint16)  # bfloat16 bits

    def test_flat_buffer_views_share_memory(self):
        with local_context(reduce_op="prescaled_sum", prescale=0.5) as ctx:
            w = ctx.add_gradient(6, name="w")
            b = ctx.add_gradient(3, sfsync.DTYPE_FLOAT64, name="b")
            h = ctx.add_gradient(4, sfsync.DTYPE_FLOAT16, name="h")
            vw, vb, vh = (ctx.gradient_array(i) for i in (w, b, h))
            self.assertEqual((vw.dtype, vb.dtype, vh.dtype),
                             (np.float32, np.float64, np.float16))
            self.assertEqual(vw.ctypes.data, ctx.gradient_data(w))
            self.assertEqual(vb.ctypes.data, ctx.gradient_data(b))
            again = ctx.gradient_array(w)
            self.assertTrue(np.shares_memory(vw, again))
            self.assertFalse(np.shares_memory(vw, vb))
            self.assertTrue(vw.flags.writeable)
            self.assertEqual(vw.tolist(), [0.0] * 6)  # the flat buffer starts zeroed
            vw[:] = np.arange(6)
            self.assertEqual(again.tolist(), [0, 1, 2, 3, 4, 5])
            vb[:] = [2.0, 4.0, 8.0]
            vh[:] = 3.0
            ctx.synchronize()  # one rank, prescaled sum: x * 0.5, in place
            self.assertEqual(vw.tolist(), [0, 0.5, 1, 1.5, 2, 2.5])
            self.assertEqual(vb.tolist(), [1.0, 2.0, 4.0])
            self.assertEqual(vh.tolist(), [1.5] * 4)
            ctx.zero_gradients()
            self.assertEqual((vw.sum(), vb.sum(), vh.sum()), (0, 0, 0))
            self.assertEqual(ctx.stats()["collectives_issued"], 3)

    def test_views_keep_the_context_alive(self):
        ctx = local_context()
        gid = ctx.add_gradient(5)
        view = ctx.gradient_array(gid)
        del ctx
        import gc
        gc.collect()
        view[:] = 7.0  # would be a use-after-free if the context had been destroyed
        self.assertEqual(view.sum(), 35.0)

    def test_registered_host_buffers(self):
        with local_context(reduce_op="sum") as ctx:
            a = np.arange(5, dtype=np.float32)
            gid = ctx.register_gradient(a, name="a")
            self.assertEqual(ctx.gradient_data(gid), a.ctypes.data)
            self.assertTrue(np.shares_memory(ctx.gradient_array(gid), a))
            ctx.synchronize()
            self.assertEqual(a.tolist(), [0, 1, 2, 3, 4])
            with self.assertRaises(TypeError):
                ctx.register_gradient(np.zeros(3, np.int32))
        with local_context() as ctx:
            with self.assertRaisesRegex(sfsync.InvalidArgumentError, "C-contiguous"):
                ctx.register_gradient(np.zeros((4, 4), np.float32)[:, 0])

    def test_default_context(self):
        d1, d2 = sfsync.Context.default(), sfsync.Context.default()
        self.assertEqual(ctypes.addressof(d1.handle.contents), ctypes.addressof(d2.handle.contents))
        d1.close()  # not owned: sf_destroy is not called
        self.assertFalse(d2.closed)
        self.assertIn(d2.in_accumulation(), (True, False))


class DictStore:
    """A key-value store in this process (a dict and a condition): what a host
    hands to Context.set_store, here for ranks that are threads."""

    def __init__(self):
        self.data = {}
        self.cond = threading.Condition()
        self.sets = 0

    def set(self, key, value):
        with self.cond:
            self.data[key] = bytes(value)
            self.sets += 1
            self.cond.notify_all()

    def get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000.0):
                raise TimeoutError(key)
            return self.data[key]


def run_thread_ranks(test, world, open_context, body):
    """Runs body(ctx, rank) for every rank on its own thread, each with the
    context open_context(rank) (closed after); returns (results, errors) by
    rank and fails `test` if a rank is still running after 60 s."""
    results, errors = [None] * world, [None] * world

    def run(rank):
        try:
            with open_context(rank) as ctx:
                results[rank] = body(ctx, rank)
        except BaseException as e:  # noqa: B902 - reported by the caller
            errors[rank] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    test.assertFalse(any(t.is_alive() for t in threads), "a rank hung")
    return results, errors


class HostStoreFromPython(unittest.TestCase):
    """Context.set_store with Python callables (called from sfsync's threads,
    ctypes taking the GIL), connect, broadcast and the replica check."""

    def run_ranks(self, body, store, world=2, prefix="job", timeout_ms=20000):
        def open_context(rank):
            ctx = sfsync.Context(rank=rank, world_size=world, rendezvous="host://",
                                 timeout_ms=timeout_ms)
            try:
                ctx.set_store(store.set, store.get, prefix)
            except BaseException:
                ctx.close()
                raise
            return ctx
        return run_thread_ranks(self, world, open_context, body)

    def test_connect_broadcast_and_check(self):
        store = DictStore()

        def body(ctx, rank):
            ctx.connect()
            buf = np.full(100000, rank + 1, dtype=np.float32)  # 400 KB: a large value path
            ctx.broadcast(buf, root=1)
            same = sfsync.digest(buf)
            ctx.check_replicas(same)
            try:
                ctx.check_replicas(rank)  # rank 1 differs
                mismatch = None
            except sfsync.MismatchError as e:
                mismatch = str(e)
            return buf[[0, -1]].tolist(), mismatch
        results, errors = self.run_ranks(body, store)
        self.assertEqual(errors, [None, None])
        for rank in (0, 1):
            self.assertEqual(results[rank][0], [2.0, 2.0])  # rank 1's values everywhere
            self.assertRegex(results[rank][1], r"sf_check_replicas: .*rank 1")
        self.assertGreater(store.sets, 0)
        self.assertTrue(all(k.startswith("job") for k in store.data), list(store.data))

    def test_store_errors_become_statuses(self):
        """A get callback that raises (not a timeout) is a store error: the
        exception does not cross into C, connect fails naming the key."""
        class Broken(DictStore):
            def get(self, key, timeout_ms):
                raise KeyError("the store lost %s" % key)

        def body(ctx, rank):
            ctx.connect()
        results, errors = self.run_ranks(body, Broken(), timeout_ms=3000)
        for e in errors:
            self.assertIsInstance(e, sfsync.SfError)
            self.assertIn("sf_connect", str(e))

    def test_a_missing_peer_times_out(self):
        store = DictStore()

        def body(ctx, rank):
            if rank == 0:
                ctx.connect()
        import time
        t0 = time.monotonic()
        results, errors = self.run_ranks(body, store, timeout_ms=1000)
        self.assertIsInstance(errors[0], (sfsync.SfTimeoutError, sfsync.BackendError))
        self.assertIsNone(errors[1])
        self.assertLess(time.monotonic() - t0, 1.0 + 10.0)

    def test_set_store_arguments(self):
        with sfsync.Context(rank=0, world_size=1, rendezvous="") as ctx:
            store = sfsync.Store()
            sfsync.lib().sf_store_init(ctypes.byref(store), ctypes.sizeof(store))
            with self.assertRaisesRegex(sfsync.InvalidArgumentError, r"store->set is NULL"):
                sfsync.lib().sf_set_store(ctx.handle, ctypes.byref(store), None)
            with self.assertRaisesRegex(sfsync.InvalidArgumentError, "struct_size"):
                sfsync.lib().sf_store_init(ctypes.byref(store), 8)


class TwoRanksInOneProcess(unittest.TestCase):
    """Two contexts on threads meeting through a memory:// store (ctypes
    releases the GIL during each call, so the threads really run together)."""

    def run_ranks(self, body, world=2):
        name = "memory://pytest-%s" % uuid.uuid4().hex
        return run_thread_ranks(
            self, world,
            lambda rank: sfsync.Context(rank=rank, world_size=world, rendezvous=name,
                                        timeout_ms=20000),
            body)

    def test_average_once_per_window(self):
        def body(ctx, rank):
            ids = [ctx.add_gradient(n, name="g%d" % n) for n in (7, 300, 5000)]
            views = [ctx.gradient_array(i) for i in ids]
            out = []
            for window in range(3):
                with ctx.accumulate():
                    for v in views:
                        v += rank + 1  # micro-batch 1..N-1: local sums
                    inside = ctx.stats()["collectives_issued"]
                for v in views:
                    v += 10 * (rank + 1)  # the last micro-batch
                ctx.synchronize()
                out.append(([v.copy() for v in views], inside, ctx.stats()))
                ctx.zero_gradients()
            return out

        results, errors = self.run_ranks(body)
        self.assertEqual(errors, [None, None])
        for rank in (0, 1):
            for window, (values, inside, stats) in enumerate(results[rank]):
                for v in values:  # (1 + 10 + 2 + 20) / 2
                    self.assertTrue(np.all(v == 16.5), (rank, window, v[:3]))
                self.assertEqual(inside, stats["bucket_count"] * window)
                self.assertEqual(stats["collectives_issued"], stats["bucket_count"] * (window + 1))
                self.assertEqual(stats["bytes_reduced"], 4 * 5307 * (window + 1))

    def test_weighted_window_divides_by_the_global_weight(self):
        """reduce_op="weighted" (Since 0.4) through the binding: the sum over
        ranks divided by the sum of every rank's weights, the window sums
        delivered, and the same collectives and bytes as an averaging
        window (nothing added on the wire's count)."""
        def body(ctx, rank):
            ids = [ctx.add_gradient(n, sfsync.DTYPE_FLOAT64, name="g%d" % n) for n in (7, 3000)]
            views = [ctx.gradient_array(i) for i in ids]
            out = []
            for window in range(2):
                with ctx.accumulate():
                    for v in views:
                        v += rank + 1
                    ctx.add_window_weight(3 + rank)
                    ctx.add_window_sums([0.25, rank + 1])
                for v in views:
                    v += 10 * (rank + 1)
                ctx.add_window_weight(2)
                ctx.add_window_sums([0.5, 1, 0, 7])
                ctx.synchronize()
                out.append(([v.copy() for v in views], ctx.window_totals(), ctx.stats()))
                ctx.zero_gradients()
            return out

        def weighted(rank, name):
            return sfsync.Context(rank=rank, world_size=2, rendezvous=name, timeout_ms=20000,
                                  reduce_op="weighted")
        name = "memory://pytest-%s" % uuid.uuid4().hex
        results, errors = run_thread_ranks(self, 2, lambda rank: weighted(rank, name), body)
        self.assertEqual(errors, [None, None])
        plain, errors = self.run_ranks(lambda ctx, rank: [
            ctx.add_gradient(7, sfsync.DTYPE_FLOAT64), ctx.add_gradient(3000, sfsync.DTYPE_FLOAT64),
            [ctx.synchronize() for _ in range(2)], ctx.stats()][-1])
        self.assertEqual(errors, [None, None])
        for rank in (0, 1):
            for window, (values, (weight, sums), stats) in enumerate(results[rank]):
                self.assertEqual(weight, 3 + 4 + 2 + 2)
                self.assertEqual(sums, [1.5, 5.0, 0.0, 14.0])
                for v in values:  # (1 + 10 + 2 + 20) / 11
                    self.assertTrue(np.all(v == 33 / 11), (rank, window, v[:3]))
            stats = results[rank][-1][2]
            for key in ("collectives_issued", "bytes_reduced", "bucket_count"):
                self.assertEqual(stats[key], plain[rank][key], key)

    def test_different_restored_counts_fail_on_every_rank(self):
        def body(ctx, rank):
            ctx.add_gradient(10, name="w")
            ctx.restore_windows(8 if rank == 0 else 9)
            ctx.synchronize()

        results, errors = self.run_ranks(body)
        for rank in (0, 1):
            e = errors[rank]
            self.assertIsInstance(e, sfsync.MismatchError, "rank %d: %r" % (rank, e))
            self.assertRegex(e.message, r"^sf_synchronize: ranks are out of step: this rank is "
                             r"synchronizing window %d, the ranks' window numbers range from 9 "
                             r"to 10" % (9 + rank))

    def test_layout_mismatch_fails_on_every_rank(self):
        def body(ctx, rank):
            ctx.add_gradient(10, name="shared")
            ctx.add_gradient(20 if rank == 0 else 21, name="differs")
            ctx.synchronize()

        results, errors = self.run_ranks(body)
        for rank in (0, 1):
            e = errors[rank]
            self.assertIsInstance(e, sfsync.MismatchError, "rank %d: %r" % (rank, e))
            self.assertEqual(e.status, sfsync.ERR_MISMATCH)
            self.assertRegex(e.message, r"^sf_synchronize: ranks registered different gradient "
                             r"layouts: the first difference is gradient 1 \('differs'\)")


if __name__ == "__main__":
    unittest.main()
