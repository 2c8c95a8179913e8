//go:build !linux

package region

import (
	"errors"
	"os"

	"github.com/shuntnet/shunt/shm/wait"
)

// ErrNotOurs means a region file exists that hostd did not create.
var ErrNotOurs = errors.New("shunt region: not a region file that hostd created")

var errUnsupported = errors.New("shunt region files: Linux only")

// Files keeps region files and their shadows (Linux only).
type Files struct{ StateDir string }

// Access says who may map a region file besides hostd.
type Access struct{ Gid int }

// NoGroup is the Access of a file only hostd's user may open.
var NoGroup = Access{Gid: -1}

func OpenFiles(stateDir string) (*Files, error) { return nil, errUnsupported }
func SecureDir(dir string) error                { return errUnsupported }
func (fl *Files) Create(path, name string, m Meta, g Geometry, a Access, sig wait.Signal) (*Pool, *os.File, error) {
	return nil, nil, errUnsupported
}
func (fl *Files) Adopt(path, name string, a Access, sig wait.Signal) (*Pool, Meta, *os.File, []error, error) {
	return nil, Meta{}, nil, nil, errUnsupported
}
func (fl *Files) Remove(path, name string) error        { return errUnsupported }
func (fl *Files) Names(prefix string) ([]string, error) { return nil, errUnsupported }
func (fl *Files) CreateSealed(name string, m Meta, g Geometry, sig wait.Signal) (*Pool, *os.File, error) {
	return nil, nil, errUnsupported
}
func (fl *Files) AdoptSealed(name string, sig wait.Signal) (*Pool, Meta, *os.File, []error, error) {
	return nil, Meta{}, nil, nil, errUnsupported
}
func (fl *Files) RemoveState(name string) error { return errUnsupported }
