"""The tests a pytest run skipped, as node ids, one a line, from its JUnit
report (a module skipped whole as it was collected: its path); those in
the files given after the report are left out (they run whole anyway).
Used by .ci/run: the tests have no classes, so a case's classname is its
module's dotted path."""

import sys
import xml.etree.ElementTree as ET


def main(report: str, whole: list[str]) -> None:
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is None:
            continue
        classname, name = case.get("classname", ""), case.get("name", "")
        if not classname:  # a module skipped whole, as it was collected
            path, test = name.replace(".", "/") + ".py", ""
        else:
            path, test = classname.replace(".", "/") + ".py", f"::{name}"
        if path not in whole:
            print(path + test)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
