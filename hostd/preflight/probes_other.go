//go:build !linux

package preflight

import "errors"

var errNotLinux = errors.New("hostd needs Linux")

func conntrackProbe(string) error                { return errNotLinux }
func sysctlProbe(string, string) (string, error) { return "", errNotLinux }
func witnessProbe() error                        { return errNotLinux }
func interfaceProbe(string, string) error        { return errNotLinux }
func statfsProbe(string) (FS, error)             { return FS{}, errNotLinux }
