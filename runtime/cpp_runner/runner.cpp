/* recompile_runner: runs an AOTInductor package (recompile.package) from C++.
 *
 *   recompile_runner PACKAGE.pt2 INPUTS.pt OUTPUTS.pt [--no-python]
 *
 * INPUTS.pt holds the package's flattened inputs as torch.save wrote them (a list of tensors); the outputs are
 * written the same way (torch.load reads them). Before loading the package the operator library is loaded:
 * runtime/_C's native operators (torch.ops.recompile_native.*, C++), found next to this runner's source tree or
 * through RECOMPILE_NATIVE_LIB; and, unless --no-python, the torch.ops.recompile.* operators, which are
 * torch.library custom ops defined in Python: the runner embeds the interpreter and imports `recompile.runtime` (found on
 * PYTHONPATH; torch from the site-packages of the Python that built the runner, RECOMPILE_SITE_PACKAGES) once,
 * then releases it; the package's C++ code calls those operators through the dispatcher. A
 * package of ATen and recompile_native operators only runs with --no-python. */
#include <Python.h>
#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace {

std::vector<char> read_file(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("recompile_runner: cannot read " + path);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string &path, const std::vector<char> &data) {
    std::ofstream out(path, std::ios::binary);
    out.write(data.data(), (std::streamsize)data.size());
    if (!out) throw std::runtime_error("recompile_runner: cannot write " + path);
}

std::vector<at::Tensor> tensors(const c10::IValue &value) {
    std::vector<at::Tensor> out;
    if (value.isTensor()) return {value.toTensor()};
    if (value.isList()) {
        for (const auto &v : value.toListRef()) out.push_back(v.toTensor());
    } else if (value.isTuple()) {
        for (const auto &v : value.toTupleRef().elements()) out.push_back(v.toTensor());
    } else {
        throw std::runtime_error("recompile_runner: the inputs file must hold a tensor or a list of tensors");
    }
    return out;
}

/* The native operators (C++): dlopen'ed globally, their TORCH_LIBRARY registrations run. */
void load_native(const char *path) {
    if (!path || !*path) return;
    if (!dlopen(path, RTLD_NOW | RTLD_GLOBAL))
        throw std::runtime_error(std::string("recompile_runner: cannot load the operator library: ") + dlerror());
}

/* torch.ops.recompile.* (Python custom ops): import `recompile.runtime` in an embedded interpreter, then release it. */
PyThreadState *load_python_ops() {
    Py_Initialize();
    const std::string path = std::string("import sys; sys.path.append('") + RECOMPILE_SITE_PACKAGES + "')";
    if (PyRun_SimpleString(path.c_str()) != 0 || PyRun_SimpleString("import recompile.runtime") != 0)
        throw std::runtime_error("recompile_runner: `import recompile.runtime` failed (is the project on PYTHONPATH?)");
    return PyEval_SaveThread();
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 4) {
        std::cerr << "usage: recompile_runner PACKAGE.pt2 INPUTS.pt OUTPUTS.pt [--no-python]\n";
        return 2;
    }
    const bool python = !(argc > 4 && std::string(argv[4]) == "--no-python");
    try {
        PyThreadState *state = nullptr;
        if (python) {
            state = load_python_ops();  // loads runtime/_C too
        } else {
            load_native(std::getenv("RECOMPILE_NATIVE_LIB"));
        }
        const std::vector<at::Tensor> inputs = tensors(torch::jit::pickle_load(read_file(argv[2])));
        std::vector<at::Tensor> outputs;
        {
            torch::inductor::AOTIModelPackageLoader loader(argv[1]);
            outputs = loader.run(inputs);
        }
        std::vector<c10::IValue> values(outputs.begin(), outputs.end());  // a tuple: torch.load(weights_only) reads it
        write_file(argv[3], torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(values))));
        if (state) {
            PyEval_RestoreThread(state);
            Py_Finalize();
        }
        std::cout << "recompile_runner: " << inputs.size() << " inputs, " << outputs.size() << " outputs\n";
    } catch (const std::exception &e) {
        std::cerr << e.what() << "\n";
        return 1;
    }
    return 0;
}
