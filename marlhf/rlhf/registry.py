"""Name → component class for a package of components, one module per component (the termination rules in
:mod:`marlhf.rlhf.termination`, the advantage estimators in :mod:`marlhf.rlhf.advantages`).  A module registers
its class under its own file name (the value of the component's flag, which the config lists from the file
names without importing them); a module added after the package was imported is imported when asked for."""

from __future__ import annotations

import importlib
import pkgutil
import sys


class Registry(dict):
    def __init__(self, package: str, what: str, flag: str):
        super().__init__()
        self.package, self.what, self.flag = package, what, flag

    def register(self, name: str):
        """Class decorator: make ``name`` a value of the flag."""

        def add(cls):
            if cls.__module__.rsplit(".", 1)[-1] != name:  # the command line lists the modules' names
                raise ValueError(f"{self.what} {name!r} must live in a module of that name, not {cls.__module__}")
            if name in self:
                raise ValueError(f"{self.what} {name!r} registered twice ({self[name].__module__}, {cls.__module__})")
            cls.name = name
            self[name] = cls
            return cls

        return add

    def module_names(self) -> list[str]:
        return [m.name for m in pkgutil.iter_modules(sys.modules[self.package].__path__)]

    def discover(self) -> None:
        """Import every module of the package (each registers itself)."""
        for name in self.module_names():
            importlib.import_module(f"{self.package}.{name}")

    def lookup(self, name: str):
        """The class registered as ``name``; a ValueError naming the valid ones otherwise."""
        if name not in self and name in self.module_names():  # a module added since the package was imported
            importlib.import_module(f"{self.package}.{name}")
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"{self.flag}={name!r} is not valid; choose one of {', '.join(self)}") from None
