//go:build !linux

package sys

import (
	"errors"
	"os"
	"sync/atomic"
	"time"
)

// ErrUnsupported is returned by every call on systems other than Linux.
var ErrUnsupported = errors.New("shunt: shared memory and futexes need Linux")

func Memfd(name string, size int64) (*os.File, error) { return nil, ErrUnsupported }

// Sealed: see sys_linux.go.
const Sealed = 0

func SealedMemfd(name string, size int64) (*os.File, error)       { return nil, ErrUnsupported }
func Seals(f *os.File) (int, error)                               { return 0, ErrUnsupported }
func Map(f *os.File, size int) ([]byte, error)                    { return nil, ErrUnsupported }
func Unmap(mem []byte) error                                      { return ErrUnsupported }
func Retire(mem []byte) error                                     { return ErrUnsupported }
func Yield()                                                      {}
func FutexWait(w *atomic.Uint32, v uint32, t time.Duration) error { return ErrUnsupported }
func FutexWake(w *atomic.Uint32, n int) (int, error)              { return 0, ErrUnsupported }

// FutexWaitv: see futexwaitv_unsafe.go.
const FutexWaitvMax = 128

type FutexWaitv struct{}

func (v *FutexWaitv) Set(word *atomic.Uint32, val uint32) {}

var ErrFutexFault = errors.New("futex_waitv: a word is not mapped")

func FutexWaits(vs []FutexWaitv, deadline time.Time) error { return ErrUnsupported }
