"""The digits loader: scikit-learn's data, read without importing scikit-learn."""
import subprocess
import sys

import numpy as np
import pytest
from sklearn.datasets import load_digits

from jabasray.data import digits_arrays, load_digits_split


def test_digits_arrays_equal_scikit_learns_load_digits():
    X, y = digits_arrays()
    X_ref, y_ref = load_digits(return_X_y=True)
    assert X.dtype == np.float64 and y.dtype == np.int64
    np.testing.assert_array_equal(X, X_ref)
    np.testing.assert_array_equal(y, y_ref)


def test_without_the_bundled_file_it_falls_back_to_load_digits(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    X, y = digits_arrays()
    X_ref, y_ref = load_digits(return_X_y=True)
    np.testing.assert_array_equal(X, X_ref)
    np.testing.assert_array_equal(y, y_ref)
    assert y.dtype == np.int64


def test_loading_the_split_does_not_import_scikit_learn():
    code = ("import sys; from jabasray.data import load_digits_split; tr, va = load_digits_split(); "
            "print(len(tr), len(va), 'sklearn' in sys.modules, 'scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    _, y = load_digits(return_X_y=True)
    n_val = sum(round(int((y == c).sum()) * 0.2) for c in range(10))
    assert out == [str(len(y) - n_val), str(n_val), "False", "False"]


@pytest.mark.parametrize("image", [True, False])
def test_split_is_stratified_disjoint_and_covers_every_sample(image):
    train, val = load_digits_split(image=image)
    X_ref, y_ref = load_digits(return_X_y=True)
    X = np.concatenate([train.tensors[0].reshape(len(train), -1).numpy(),
                        val.tensors[0].reshape(len(val), -1).numpy()])
    y = np.concatenate([train.tensors[1].numpy(), val.tensors[1].numpy()])
    # the union of the two sets is the data set, each sample once (rows as pixel tuples + label)
    rows = sorted(map(tuple, np.column_stack([X * 16.0, y]).round(6)))
    ref = sorted(map(tuple, np.column_stack([X_ref, y_ref]).astype(np.float32).astype(np.float64).round(6)))
    assert rows == ref
    assert train.tensors[0].shape[1:] == ((1, 8, 8) if image else (64,))
    for c in range(10):      # every class holds round(20 %) of its samples in validation
        n_c = int((y_ref == c).sum())
        assert int((val.tensors[1] == c).sum()) == max(1, round(n_c * 0.2))
