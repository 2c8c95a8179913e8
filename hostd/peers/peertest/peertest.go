// Package peertest makes the TLS material of peer hostds for tests: a CA
// and certificates naming hostds, as PEM files.
package peertest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"time"
)

// CA is a certificate authority whose files live in Dir.
type CA struct {
	Dir  string
	Path string // the CA's certificate (PEM): hostd.hcl's peering ca
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA makes a CA called name, valid for a day, with its files in dir.
func NewCA(dir, name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	c := &CA{Dir: dir, cert: cert, key: key}
	c.Path, err = c.write(name+"-ca.pem", "CERTIFICATE", der)
	return c, err
}

func (c *CA) write(name, typ string, der []byte) (string, error) {
	p := filepath.Join(c.Dir, name)
	return p, os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// Issue makes a certificate for a hostd named name (its DNS name) and
// returns the paths of the certificate and its key.
func (c *CA) Issue(name string) (cert, key string, err error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return "", "", err
	}
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &k.PublicKey, c.key)
	if err != nil {
		return "", "", err
	}
	kd, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		return "", "", err
	}
	base := fmt.Sprintf("%s-%s", name, serial)
	if cert, err = c.write(base+".pem", "CERTIFICATE", der); err != nil {
		return "", "", err
	}
	key, err = c.write(base+".key", "EC PRIVATE KEY", kd)
	return cert, key, err
}
