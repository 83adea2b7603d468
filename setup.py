from setuptools import setup

# Everything declarative lives in pyproject.toml; cffi_modules cannot.
setup(cffi_modules=["csrc/build.py:ffibuilder"])
